"""Data parallelism: ``--data-parallel-size N`` engine replicas behind one API server.

::

    API server (asyncio)                                replica i (a process)
    --------------------                                ---------------------
    DataParallelLLM.add_request -- route: fewest        AsyncLLM (its own engine thread,
      waiting, then running --> Pipe i ("add", ...) --> scheduler, KV cache; TP ranks of
    reader thread i <-- ("added"|"output"|"error"|      its own with -tp > 1)
      "stats") -- streams, routing counts, metrics

Each replica is a whole engine (``AsyncLLM`` in its own process, bound to its share of the
CPUs); the server's handlers see one engine with ``AsyncLLM``'s interface. A request stays
on the replica it was routed to. Routing counts are kept here, exactly: a request is
*waiting* from its routing to its first output, then *running* until it ends. Each
replica's stats arrive with its index and are exported labelled ``engine="<index>"``.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing.connection
import os
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import torch

from pagedserve.engine.args import EngineArgs
from pagedserve.engine.async_engine import (
    AsyncLLM,
    EngineClosedError,
    EngineStepError,
    RequestStream,
)
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaSummary:
    """What the server reads from an engine (the names ``LLMEngine`` has), sent by replica 0.
    ``tokenizer`` is loaded in the server's process."""

    model_path: object
    max_model_len: int
    device: str
    dtype: torch.dtype
    num_blocks: int
    args: EngineArgs
    scheduler_config: object
    cache_info: dict
    tokenizer: object = None

    def cache_config_info(self) -> dict[str, str]:
        return self.cache_info


def replica_cpus(index: int, num_replicas: int) -> set[int]:
    """The CPUs replica ``index`` is bound to: a contiguous share of this process's, or all
    of them where there are fewer CPUs than replicas."""
    cpus = sorted(os.sched_getaffinity(0))
    share = len(cpus) // num_replicas
    if share == 0:
        return set(cpus)
    return set(cpus[index * share : (index + 1) * share])


class _PipeStatLogger:
    """A replica's stat logger: forwards the stats to the server (its Prometheus logger)."""

    def __init__(self, send) -> None:
        self.send = send

    def record(self, scheduler_stats, iteration_stats) -> None:
        self.send(("stats", scheduler_stats, iteration_stats))


def run_replica(index: int, args: EngineArgs, conn: multiprocessing.connection.Connection,
                cpus: set[int]) -> None:
    """Entry point of replica ``index``: an ``AsyncLLM`` serving the server's commands from
    ``conn`` until ``shutdown`` or until the server goes away."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s replica {index} "
                        "%(levelname)s %(name)s: %(message)s")
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))
    lock = threading.Lock()

    def send(message: tuple) -> None:
        with lock:
            conn.send(message)

    try:
        llm = AsyncLLM.from_engine_args(replace(args, data_parallel_size=1),
                                        _PipeStatLogger(send))
    except Exception as err:  # noqa: BLE001 - reported to the server, which raises it
        send(("failed", err))
        return
    core = llm.engine
    send(("ready", ReplicaSummary(core.model_path, core.max_model_len, core.device, core.dtype,
                                  core.num_blocks, core.args, core.scheduler_config,
                                  core.cache_config_info())))
    try:
        asyncio.run(_serve_commands(llm, conn, send))
    finally:
        llm.shutdown()


async def _serve_commands(llm: AsyncLLM, conn, send) -> None:
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task] = set()
    while True:
        try:
            command, *payload = await loop.run_in_executor(None, conn.recv)
        except EOFError:  # the server is gone
            return
        if command == "add":
            task = asyncio.create_task(_run_request(llm, send, *payload))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        elif command == "abort":
            llm.abort(payload[0])
        elif command == "abort_all":
            llm.abort_all(payload[0])
        elif command == "shutdown":
            return


async def _run_request(llm: AsyncLLM, send, request_id: str, prompt, params: SamplingParams,
                       arrival_time: float) -> None:
    try:
        stream = await llm.add_request(request_id, prompt, params, arrival_time)
    except Exception as err:  # noqa: BLE001 - ValueError etc.: the server's caller gets it
        send(("error", request_id, err))
        return
    send(("added", request_id))
    try:
        async for out in stream:
            send(("output", request_id, out))
    except Exception as err:  # noqa: BLE001 - EngineStepError, RequestAbortedError
        send(("error", request_id, err))


@dataclass
class _Routed:
    replica: int
    stream: RequestStream
    loop: asyncio.AbstractEventLoop
    added: asyncio.Future
    running: bool = False


class DataParallelLLM:
    """``args.data_parallel_size`` replicas with ``AsyncLLM``'s serving interface
    (``add_request``, ``generate``, ``abort``, ``abort_all``, ``is_running``, ``start``,
    ``shutdown``); ``engine`` summarizes replica 0 for the server; ``processes`` are the
    replicas' processes. A replica that exits fails its requests (``EngineStepError``) and
    makes ``is_running`` False (the server's ``/health`` 503).

    Starts the replicas and waits until all are built; raises what a replica's
    ``LLMEngine`` raised (``ValueError`` for bad arguments), or ``RuntimeError`` when one
    exits while starting. Each replica is bound to ``cores / N`` CPUs.
    """

    def __init__(self, args: EngineArgs, stat_logger=None) -> None:
        n = args.data_parallel_size
        self.stat_logger = stat_logger
        self._lock = threading.Lock()
        self._requests: dict[str, _Routed] = {}
        self._counts = [[0, 0] for _ in range(n)]  # per replica: [waiting, running]
        self._closing = False
        self._dead: set[int] = set()
        ctx = torch.multiprocessing.get_context("spawn")
        self._conns, self.processes = [], []
        for i in range(n):
            ours, theirs = ctx.Pipe()
            # not daemonic: a replica starts processes of its own (tensor-parallel ranks)
            proc = ctx.Process(target=run_replica, name=f"pagedserve-replica-{i}",
                               args=(i, args, theirs, replica_cpus(i, n)))
            proc.start()
            theirs.close()
            self._conns.append(ours)
            self.processes.append(proc)
        self.num_threads = len(replica_cpus(0, n))
        try:
            summaries = [self._wait_ready(i) for i in range(n)]
        except BaseException:
            self.shutdown()
            raise
        tokenizer = None
        if not args.skip_tokenizer_init:
            from pagedserve.models.loader import resolve_model_path
            from pagedserve.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(resolve_model_path(args.tokenizer) if args.tokenizer
                                       else summaries[0].model_path)
        self.engine = replace(summaries[0], tokenizer=tokenizer)
        self._readers = [threading.Thread(target=self._read, args=(i,), daemon=True,
                                          name=f"pagedserve-replica-reader-{i}")
                         for i in range(n)]
        for t in self._readers:
            t.start()

    def _wait_ready(self, i: int) -> ReplicaSummary:
        try:
            kind, value = self._conns[i].recv()
        except EOFError:
            raise RuntimeError(f"data-parallel replica {i} exited with code "
                               f"{self.processes[i].exitcode} while starting") from None
        if kind == "failed":
            raise value
        return value

    # -- the serving interface ---------------------------------------------------------

    def start(self) -> None:
        """Nothing to do: the replicas run from construction."""

    @property
    def is_running(self) -> bool:
        """True while every replica runs and the server is not shutting down."""
        return not self._closing and not self._dead

    async def add_request(self, request_id: str, prompt, params: SamplingParams,
                          arrival_time: float | None = None) -> RequestStream:
        """As ``AsyncLLM.add_request``: routes the request to the replica with the fewest
        waiting, then running requests."""
        loop = asyncio.get_running_loop()
        arrival = time.monotonic() if arrival_time is None else arrival_time
        routed = _Routed(-1, RequestStream(request_id, self), loop, loop.create_future())
        with self._lock:
            if self._closing:
                raise EngineClosedError("the server is shutting down")
            if request_id in self._requests:
                raise ValueError(f"request id {request_id!r} is already in use")
            live = [i for i in range(len(self._conns)) if i not in self._dead]
            if not live:
                raise EngineClosedError("every data-parallel replica has exited")
            routed.replica = min(live, key=lambda i: (*self._counts[i], i))
            self._counts[routed.replica][0] += 1
            self._requests[request_id] = routed
            self._conns[routed.replica].send(("add", request_id, prompt, params, arrival))
        await routed.added
        return routed.stream

    async def generate(self, prompt, params: SamplingParams, request_id: str,
                       arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """As ``AsyncLLM.generate``."""
        stream = await self.add_request(request_id, prompt, params, arrival_time)
        async for out in stream:
            yield out

    def abort(self, request_id: str) -> None:
        """Abort a request by id (thread-safe; unknown ids are ignored)."""
        with self._lock:
            routed = self._requests.get(request_id)
            if routed is not None and routed.replica not in self._dead:
                self._conns[routed.replica].send(("abort", request_id))

    def abort_all(self, reason: str = "the server is shutting down") -> None:
        """Refuse new requests and abort every request on every replica."""
        with self._lock:
            self._closing = True
            for i, conn in enumerate(self._conns):
                if i not in self._dead:
                    conn.send(("abort_all", reason))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything, stop the replicas (killed after ``timeout`` s)."""
        with self._lock:
            self._closing = True
            for i, conn in enumerate(self._conns):
                if i not in self._dead:
                    try:
                        conn.send(("shutdown",))
                    except OSError:  # it is gone already
                        pass
        deadline = time.monotonic() + timeout
        for proc in self.processes:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()

    # -- the reader threads ------------------------------------------------------------

    def _read(self, i: int) -> None:
        conn = self._conns[i]
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                self._replica_gone(i)
                return
            kind, *payload = message
            if kind == "stats":
                if self.stat_logger is not None:
                    self.stat_logger.record(*payload, engine_idx=i)
            else:
                self._deliver(i, kind, *payload)

    def _deliver(self, i: int, kind: str, request_id: str, value=None) -> None:
        with self._lock:
            routed = self._requests.get(request_id)
            if routed is None:
                return
            counts = self._counts[i]
            ended = kind == "error" or (kind == "output" and value.finished)
            if kind == "output" and not routed.running:
                routed.running = True
                counts[0] -= 1
                counts[1] += 1
            if ended:
                counts[1 if routed.running else 0] -= 1
                del self._requests[request_id]
        if kind == "added":
            routed.loop.call_soon_threadsafe(_set_result, routed.added, None)
        elif kind == "error" and not routed.added.done():
            routed.loop.call_soon_threadsafe(_set_exception, routed.added, value)
        else:
            routed.loop.call_soon_threadsafe(routed.stream._put, value)

    def _replica_gone(self, i: int) -> None:
        """Replica ``i``'s pipe closed: fail its requests; the server is unhealthy."""
        with self._lock:
            if self._closing:
                return
            self._dead.add(i)
            mine = [rid for rid, r in self._requests.items() if r.replica == i]
        self.processes[i].join(timeout=1.0)
        error = EngineStepError(f"data-parallel replica {i} exited with code "
                                f"{self.processes[i].exitcode}")
        logger.error("%s; failing its %d requests", error, len(mine))
        for rid in mine:
            self._deliver(i, "error", rid, error)


def _set_result(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, err: BaseException) -> None:
    if not future.done():
        future.set_exception(err)


__all__ = ["DataParallelLLM", "ReplicaSummary", "replica_cpus"]
