"""Tensor-parallel executors: ``DistributedExecutor`` (ranks 1.. elsewhere, rank 0 here)
and ``MultiprocExecutor`` (``mp``: ranks 1.. are processes on this machine,
``torch.multiprocessing``, spawn); ``ray_executor.py`` places them with Ray instead.

Rank 0 is always the driver, this process: its worker holds a shard too, the engine runs
the one scheduler, and rank 0 alone samples. ``DriverModel`` wraps its shard so that every
model call is first sent to the other ranks (``worker/worker.py``), which then run the same
call; the collectives inside the model pair up.

A rank that dies (its process exits, its actor's task ends) or hangs (a collective waits
longer than ``--distributed-timeout``) leaves the ranks out of step: the executor is then
dead for good and every later step raises ``EngineDeadError`` naming the rank or the
timeout. A watcher thread notices a death even while the engine is idle.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing.connection
import threading
from collections.abc import Iterator

import torch
from torch import nn

from pagedserve.args import EngineArgs
from pagedserve.config import resolve_device
from pagedserve.distributed.config import ParallelConfig
from pagedserve.distributed.group import RankGroup, free_port
from pagedserve.executor.base import EngineDeadError, Executor
from pagedserve.worker.model_runner import ModelRunner
from pagedserve.worker.worker import DriverHooks, Worker, rank_device, run_worker, threads_per_rank

logger = logging.getLogger(__name__)


class DriverModel(nn.Module):
    """Rank 0's shard (a ``TensorParallelModel``): each call is first broadcast to the other
    ranks as a command. Any failure inside a call leaves the ranks out of step, so it marks
    the executor dead and raises ``EngineDeadError``."""

    def __init__(self, model: nn.Module, executor: DistributedExecutor) -> None:
        super().__init__()
        self.model = model
        self.executor = executor

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        """As the model's; ``kv_caches`` are rank 0's (the others use their own)."""
        with self.executor.guard():
            self.executor.group.send_command(("forward", input_ids, positions, meta))
            return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden rows ``[N, hidden_size]`` -> logits ``[N, vocab_size]`` gathered over ranks
        (the rows are sent along: the other ranks compute their vocabulary shards of them)."""
        with self.executor.guard():
            self.executor.group.send_command(("logits", hidden))
            return self.model.compute_logits(hidden)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        with self.executor.guard():
            self.executor.group.send_command(("copy", pairs))


class DriverModelRunner(ModelRunner):
    """The model runner of rank 0: block copies (copy-on-write) happen on every rank."""

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            self.model.copy_blocks(pairs)
        super().copy_blocks(pairs)


class DistributedExecutor(Executor):
    """Ranks 1.. elsewhere (subclasses start and watch them); rank 0's worker here, built
    while the other ranks load their shards.

    Sets this process's torch threads to its share of the cores (until ``shutdown``). Raises
    what starting the ranks or loading rank 0 raises; ``RuntimeError`` if the ranks do not
    join in time.
    """

    def __init__(self, parallel: ParallelConfig, args: EngineArgs, hooks: DriverHooks) -> None:
        self.world_size = parallel.tensor_parallel_size
        self.timeout = parallel.distributed_timeout
        self.args = args
        self._dead: str | None = None
        self._closing = False
        self._exited = threading.Event()  # the watcher saw a rank end
        host = self._host()
        port = free_port(host)
        self._threads_before = torch.get_num_threads()  # restored at shutdown
        try:
            ranks_here = self._start_ranks(host, port)
            torch.set_num_threads(threads_per_rank(ranks_here))
            device = rank_device(resolve_device(args.device), 0)
            self.group = RankGroup(0, self.world_size, host, port, self.timeout, device,
                                   self._check_started)
        except BaseException:
            self.shutdown()
            raise
        threading.Thread(target=self._watch, name="pagedserve-rank-watcher", daemon=True).start()
        logger.info("%d tensor-parallel ranks joined at %s:%d; rank 0 uses %d torch threads",
                    self.world_size, host, port, torch.get_num_threads())
        try:
            self.driver_worker = Worker(args, dataclasses.replace(
                hooks, wrap_model=self.driver_model, runner_class=DriverModelRunner), 0,
                self.group)
        except BaseException:
            self.shutdown()
            raise

    # -- what backends provide -----------------------------------------------------------

    def _host(self) -> str:
        """Address the other ranks reach this process at."""
        raise NotImplementedError

    def _start_ranks(self, host: str, port: int) -> int:
        """Start ranks 1..; returns how many ranks (with rank 0) share this machine."""
        raise NotImplementedError

    def _wait_for_exit(self) -> str:
        """Block until a rank ends; return what happened to it (e.g. its exit code)."""
        raise NotImplementedError

    def _check_started(self) -> None:
        """Raise ``RuntimeError`` naming a rank that ended while the ranks were joining."""
        raise NotImplementedError

    def _stop_ranks(self, told: bool) -> None:
        """End ranks 1..: ``told`` (they got the shutdown command): let them exit on their
        own; else kill them."""
        raise NotImplementedError

    # -----------------------------------------------------------------------------------

    def driver_model(self, model: nn.Module) -> DriverModel:
        return DriverModel(model, self)

    def agree_num_blocks(self, num_blocks: int) -> int:
        """The KV pool size of every rank: the minimum over ranks of what each can hold."""
        with self.guard():
            return self.group.all_reduce_min(num_blocks)

    def check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    def is_alive(self) -> bool:
        return self._dead is None

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Raise ``EngineDeadError`` before a call if a rank is gone, and for any failure
        inside it (then the executor is dead)."""
        self.check_alive()
        try:
            yield
        except Exception as err:
            self._fail(f"a collective failed: {err}".strip(), wait_for_exit=True)
            raise EngineDeadError(self._dead) from err

    def _fail(self, reason: str, wait_for_exit: bool = False) -> None:
        """Mark the executor dead. A collective that failed because a rank died usually
        fails before the watcher saw the exit: wait a moment for it, to name the rank."""
        if wait_for_exit and self._dead is None:
            self._exited.wait(timeout=2.0)
        if self._dead is None:
            self._dead = (f"{reason} (tensor-parallel rank hung longer than "
                          f"--distributed-timeout {self.timeout:g} s, or failed)")
        logger.error("engine is dead: %s", self._dead)

    def _watch(self) -> None:
        what = self._wait_for_exit()
        if self._closing:
            return
        self._dead = what
        self._exited.set()
        logger.error("engine is dead: %s", what)

    def shutdown(self) -> None:
        """Stop ranks 1.. (idempotent)."""
        if self._closing:
            return
        self._closing = True
        told = False
        if self._dead is None and getattr(self, "group", None) is not None:
            try:
                self.group.send_command(("shutdown",))
                told = True
            except RuntimeError as err:  # a rank is already gone: it gets killed below
                logger.warning("could not send shutdown to the ranks: %s", err)
        self._stop_ranks(told)
        self.group = None
        torch.set_num_threads(self._threads_before)


class MultiprocExecutor(DistributedExecutor):
    """Ranks 1.. as spawned processes on this machine."""

    def _host(self) -> str:
        return "127.0.0.1"

    def _start_ranks(self, host: str, port: int) -> int:
        ctx = torch.multiprocessing.get_context("spawn")
        self.procs = [
            ctx.Process(target=run_worker, name=f"pagedserve-rank-{rank}", daemon=True,
                        args=(rank, self.world_size, host, port, self.args, self.world_size))
            for rank in range(1, self.world_size)
        ]
        for p in self.procs:
            p.start()
        return self.world_size

    def _wait_for_exit(self) -> str:
        sentinels = [p.sentinel for p in self.procs]
        ended = multiprocessing.connection.wait(sentinels)[0]
        rank = sentinels.index(ended) + 1
        proc = self.procs[rank - 1]
        proc.join(timeout=1.0)  # sets exitcode
        return f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"

    def _check_started(self) -> None:
        for rank, p in enumerate(self.procs, start=1):
            if not p.is_alive():
                raise RuntimeError(f"tensor-parallel rank {rank} exited with code {p.exitcode} "
                                   "while starting (see its log above)")

    def _stop_ranks(self, told: bool) -> None:
        # A told rank exits by itself (its interpreter's teardown takes seconds: not waited
        # for); multiprocessing reaps it.
        for p in getattr(self, "procs", []):
            if not told and p.is_alive():
                p.kill()
                p.join()
