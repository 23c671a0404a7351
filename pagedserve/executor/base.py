"""What every executor does for the engine, and the one-rank ``UniExecutor``.

The engine holds an executor and nothing of the model: the executor holds the workers
(``worker/worker.py``), rank 0's here, and tells the engine how many KV blocks every rank
can hold.
"""

from __future__ import annotations

from pagedserve.args import EngineArgs
from pagedserve.config import CacheConfig, SchedulerConfig
from pagedserve.core.scheduler import SchedulerOutput
from pagedserve.distributed.group import RankGroup
from pagedserve.worker.model_runner import ModelRunnerOutput
from pagedserve.worker.worker import DriverHooks, Worker


class EngineDeadError(RuntimeError):
    """A tensor-parallel rank died or hung; the engine takes no more steps."""


class Executor:
    """Rank 0's worker (``driver_worker``) and, in subclasses, the other ranks."""

    driver_worker: Worker
    group: RankGroup | None = None

    def initialize_cache(self, cache: CacheConfig, sched: SchedulerConfig) -> int:
        """Size the KV cache (the minimum over ranks), allocate it on every rank, capture
        graphs; returns the number of blocks. Raises ``ValueError`` when a rank cannot hold
        one ``max_model_len`` sequence."""
        worker = self.driver_worker
        num_blocks = self.agree_num_blocks(worker.determine_num_blocks(cache, sched))
        worker.initialize_cache(num_blocks, sched.max_num_seqs)
        return num_blocks

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.driver_worker.execute_model(sched)

    def agree_num_blocks(self, num_blocks: int) -> int:
        return num_blocks

    def check_alive(self) -> None:
        """Raise ``EngineDeadError`` if a rank is gone (never, with one rank)."""

    def is_alive(self) -> bool:
        return True

    def shutdown(self) -> None:
        pass


class UniExecutor(Executor):
    """One rank: its worker in this process (``--distributed-executor-backend uni``)."""

    def __init__(self, args: EngineArgs, hooks: DriverHooks) -> None:
        self.driver_worker = Worker(args, hooks)
