"""Data parallelism: ``--data-parallel-size N`` engine replicas behind one API server.

::

    API server (asyncio)                                replica i (a process)
    --------------------                                ---------------------
    DataParallelLLM.add_request -- route: fewest        AsyncLLM (its own engine thread,
      waiting, then running --> Pipe i ("add", ...) --> scheduler, KV cache; TP ranks of
    reader thread i <-- ("added"|"output"|"error"|      its own with -tp > 1)
      "stats") -- streams, routing counts, metrics

Each replica is a whole engine (``AsyncLLM`` in its own process, bound to its share of the
CPUs, or in a Ray actor; ``replica.py`` has its side and the messages); the server's handlers see one engine with ``AsyncLLM``'s interface. A request stays
on the replica it was routed to. Routing counts are kept here, exactly: a request is
*waiting* from its routing to its first output, then *running* until it ends. Each
replica's stats arrive with its index and are exported labelled ``engine="<index>"``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing.connection
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, TypeVar

import torch

from pagedserve.args import EngineArgs
from pagedserve.engine.replica import ReplicaActor, ReplicaSummary, replica_cpus, run_replica
from pagedserve.engine.request_stream import EngineClosedError, EngineStepError, RequestStream
from pagedserve.lora.request import LoRARequest
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedserve.engine.llm_engine import LLMEngine

T = TypeVar("T")

logger = logging.getLogger(__name__)


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
    ``shutdown``); ``engine`` summarizes replica 0 for the server. A replica that exits
    fails its requests (``EngineStepError``) and makes ``is_running`` False (the server's
    ``/health`` 503).

    Replicas are processes on this machine (``processes``; each bound to ``cores / N``
    CPUs), or with ``distributed_executor_backend="ray"`` Ray actors of 1 CPU each
    (``actors``, on the nodes ``replica_nodes``; threads: their node's cores / the replicas
    there). Starts them and waits until all are built; raises what a replica's
    ``LLMEngine`` raised (``ValueError`` for bad arguments), or ``RuntimeError`` when one
    exits while starting.
    """

    def __init__(self, args: EngineArgs, stat_logger=None) -> None:
        n = args.data_parallel_size
        self.stat_logger = stat_logger
        self._lock = threading.Lock()
        self._requests: dict[str, _Routed] = {}
        self._calls: dict[int, tuple] = {}  # run_between_steps_all: id -> (loop, future, i)
        self._call_ids = itertools.count()
        self._counts = [[0, 0] for _ in range(n)]  # per replica: [waiting, running]
        self._closing = False
        self._dead: set[int] = set()
        self.processes: list = []  # mp: the replicas' processes
        self.actors: list = []  # ray: the replicas' actors
        self._conns: list = []
        self._runs: list = []
        try:
            if args.distributed_executor_backend == "ray":
                self._conns = self._start_ray_replicas(args)
            else:
                self._conns = self._start_processes(args)
            summaries = [self._wait_ready(i) for i in range(n)]
        except BaseException:
            self.shutdown()
            raise
        tokenizer = None
        if not args.skip_tokenizer_init:
            from pagedserve.model_loader.files import resolve_model_path
            from pagedserve.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(resolve_model_path(args.tokenizer) if args.tokenizer
                                       else summaries[0].model_path)
        self.engine = replace(summaries[0], tokenizer=tokenizer)
        self._readers = [threading.Thread(target=self._read, args=(i,), daemon=True,
                                          name=f"pagedserve-replica-reader-{i}")
                         for i in range(n)]
        for t in self._readers:
            t.start()

    def _start_processes(self, args: EngineArgs) -> list:
        n = args.data_parallel_size
        ctx = torch.multiprocessing.get_context("spawn")
        conns = []
        for i in range(n):
            ours, theirs = ctx.Pipe()
            cpus = replica_cpus(i, n)
            # not daemonic: a replica starts processes of its own (tensor-parallel ranks)
            proc = ctx.Process(target=run_replica, name=f"pagedserve-replica-{i}",
                               args=(i, args, theirs, cpus, len(cpus)))
            proc.start()
            theirs.close()
            conns.append(ours)
            self.processes.append(proc)
        self.num_threads = len(replica_cpus(0, n))
        return conns

    def _start_ray_replicas(self, args: EngineArgs) -> list:
        """One actor (1 CPU) per replica, placed by Ray; each connects back over TCP and
        uses its node's cores divided by the replicas there."""
        import collections
        import secrets

        import ray

        from pagedserve.executor.ray_executor import actor_runtime_env

        n = args.data_parallel_size
        if not ray.is_initialized():
            ray.init(runtime_env=actor_runtime_env())
        authkey = secrets.token_bytes(16)
        listener = multiprocessing.connection.Listener(
            (ray.util.get_node_ip_address(), 0), authkey=authkey)
        actor_cls = ray.remote(num_cpus=1, max_concurrency=2)(ReplicaActor)
        self.actors = [actor_cls.options(runtime_env=actor_runtime_env()).remote()
                       for _ in range(n)]
        self.replica_nodes = ray.get([a.node_id.remote() for a in self.actors])
        per_node = collections.Counter(self.replica_nodes)
        self._runs = [a.run.remote(i, args, listener.address, authkey,
                                   per_node[self.replica_nodes[i]])
                      for i, a in enumerate(self.actors)]
        self.num_threads = 1
        return self._accept(listener, n)

    def _accept(self, listener, n: int) -> list:
        """The replicas' connections, by index; raises ``RuntimeError`` if an actor ends
        before it connected (``accept`` itself cannot time out: it runs on a thread)."""
        import queue

        import ray

        accepted: queue.Queue = queue.Queue()

        def accept_all() -> None:
            try:
                for _ in range(n):
                    conn = listener.accept()
                    accepted.put((conn.recv()[1], conn))
            except OSError:  # the listener was closed: starting failed
                pass

        threading.Thread(target=accept_all, daemon=True, name="pagedserve-dp-accept").start()
        conns: list = [None] * n
        with listener:
            for _ in range(n):
                while True:
                    try:
                        index, conn = accepted.get(timeout=0.2)
                        break
                    except queue.Empty:
                        done, _ = ray.wait(self._runs, timeout=0)
                        if done:
                            i = self._runs.index(done[0])
                            ray.get(done[0])  # raises the actor's error
                            raise RuntimeError(f"data-parallel replica {i} ended while starting")
                conns[index] = conn
        return conns

    def _exit_of(self, i: int) -> str:
        """How replica ``i`` ended, for messages."""
        if self.processes:
            self.processes[i].join(timeout=1.0)
            return f"exited with code {self.processes[i].exitcode}"
        return "(a Ray actor) ended"

    def _wait_ready(self, i: int) -> ReplicaSummary:
        try:
            kind, value = self._conns[i].recv()
        except EOFError:
            raise RuntimeError(f"data-parallel replica {i} {self._exit_of(i)} while starting"
                               ) from None
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
                          arrival_time: float | None = None,
                          lora_request: LoRARequest | None = None) -> RequestStream:
        """As ``AsyncLLM.add_request``: routes the request to the replica with the fewest
        waiting, then running requests. Raises ``ValueError`` for a ``lora_request``: LoRA
        adapters are served by one replica only (``LLMEngine`` refuses ``enable_lora`` with
        data parallelism)."""
        if lora_request is not None:
            raise ValueError("LoRA adapters are not served with data parallelism "
                             "(--data-parallel-size > 1)")
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
                       arrival_time: float | None = None,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """As ``AsyncLLM.generate`` (``lora_request`` is refused, as by ``add_request``)."""
        stream = await self.add_request(request_id, prompt, params, arrival_time, lora_request)
        async for out in stream:
            yield out

    async def run_between_steps_all(self, fn: Callable[[LLMEngine], T]) -> list[T]:
        """``fn(engine)`` on every live replica's engine thread between two of its steps
        (``AsyncLLM.run_between_steps``); their results in replica order. ``fn`` and its
        result cross a pipe, so both must pickle. Raises what ``fn`` raised, or
        ``EngineClosedError``."""
        loop = asyncio.get_running_loop()
        futures = []
        with self._lock:
            if self._closing:
                raise EngineClosedError("the server is shutting down")
            for i, conn in enumerate(self._conns):
                if i in self._dead:
                    continue
                call_id = next(self._call_ids)
                future = loop.create_future()
                self._calls[call_id] = (loop, future, i)
                futures.append(future)
                conn.send(("call", call_id, fn))
        return list(await asyncio.gather(*futures))

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
        if self.actors:
            import ray

            ray.wait(self._runs, num_returns=len(self._runs), timeout=timeout)
            for actor in self.actors:
                ray.kill(actor)

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
            elif kind in ("called", "call_failed"):
                call_id, value = payload
                with self._lock:
                    loop, future, _ = self._calls.pop(call_id)
                settle = _set_result if kind == "called" else _set_exception
                loop.call_soon_threadsafe(settle, future, value)
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
            calls = [self._calls.pop(c) for c, (_, _, j) in list(self._calls.items()) if j == i]
        error = EngineStepError(f"data-parallel replica {i} {self._exit_of(i)}")
        logger.error("%s; failing its %d requests", error, len(mine))
        for rid in mine:
            self._deliver(i, "error", rid, error)
        for loop, future, _ in calls:
            loop.call_soon_threadsafe(_set_exception, future, error)


def _set_result(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, err: BaseException) -> None:
    if not future.done():
        future.set_exception(err)


__all__ = ["DataParallelLLM", "ReplicaSummary", "replica_cpus"]
