"""One data-parallel replica: an ``AsyncLLM`` in its own process (or Ray actor) serving
the server's commands over a connection (a pipe, or authenticated TCP from a Ray actor).

Messages, server -> replica: ``("add", id, prompt, params, arrival_time)``,
``("abort", id)``, ``("abort_all", reason)``, ``("call", call_id, fn)``, ``("shutdown",)``.
Replica -> server: once ``("ready", ReplicaSummary)`` or ``("failed", error)``; then
``("added", id)``, ``("output", id, RequestOutput)``, ``("error", id, error)``,
``("called", call_id, result)`` / ``("call_failed", call_id, error)`` and ``("stats",
SchedulerStats, IterationStats)``. A Ray actor first sends ``("hello", index)``.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing.connection
import os
import threading
from dataclasses import dataclass, replace

import torch

from pagedserve.args import EngineArgs
from pagedserve.engine.async_engine import AsyncLLM
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
                cpus: set[int] | None, num_threads: int) -> None:
    """Entry point of replica ``index``: an ``AsyncLLM`` serving the server's commands from
    ``conn`` until ``shutdown`` or until the server goes away. ``cpus``: the CPUs to bind
    to (None: unbound); ``num_threads``: its torch threads."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s replica {index} "
                        "%(levelname)s %(name)s: %(message)s")
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    torch.set_num_threads(num_threads)
    lock = threading.Lock()

    def send(message: tuple) -> None:
        with lock:
            conn.send(message)

    # one replica: its tensor-parallel ranks (if any) use the backend asked for
    backend = args.distributed_executor_backend if args.tensor_parallel_size > 1 else None
    try:
        llm = AsyncLLM.from_engine_args(
            replace(args, data_parallel_size=1, distributed_executor_backend=backend),
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
        elif command == "call":
            task = asyncio.create_task(_run_call(llm, send, *payload))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        elif command == "abort":
            llm.abort(payload[0])
        elif command == "abort_all":
            llm.abort_all(payload[0])
        elif command == "shutdown":
            return


async def _run_call(llm: AsyncLLM, send, call_id: int, fn) -> None:
    """``DataParallelLLM.run_between_steps_all``'s call on this replica."""
    try:
        send(("called", call_id, await llm.run_between_steps(fn)))
    except Exception as err:  # noqa: BLE001 - the server's caller gets it
        send(("call_failed", call_id, err))


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


class ReplicaActor:
    """A Ray actor holding one replica (``run`` blocks for its lifetime; a second thread
    answers ``node_id``). It connects back to the server over TCP
    (``multiprocessing.connection``, authenticated) and then speaks the same messages as a
    process replica over its pipe."""

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def run(self, index: int, args: EngineArgs, address: tuple[str, int], authkey: bytes,
            replicas_here: int) -> None:
        conn = multiprocessing.connection.Client(address, authkey=authkey)
        conn.send(("hello", index))
        threads = max(1, len(os.sched_getaffinity(0)) // replicas_here)
        run_replica(index, args, conn, None, threads)
