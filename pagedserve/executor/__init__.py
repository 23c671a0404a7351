"""Executors: where an engine's workers run.

::

    base.py          Executor (what the engine calls), UniExecutor (``uni``: one rank here)
    multiproc.py     DistributedExecutor, MultiprocExecutor (``mp``: ranks 1.. as processes)
    ray_executor.py  RayExecutor (``ray``: ranks 1.. as Ray actors)
"""

from __future__ import annotations

from pagedserve.args import EngineArgs
from pagedserve.distributed.config import ParallelConfig
from pagedserve.executor.base import EngineDeadError, Executor, UniExecutor
from pagedserve.worker.worker import DriverHooks

__all__ = ["EngineDeadError", "Executor", "create_executor"]


def create_executor(parallel: ParallelConfig, args: EngineArgs, hooks: DriverHooks
                    ) -> Executor:
    """The executor of ``parallel.backend`` (``uni``, ``mp`` or ``ray``) with its workers
    loaded (rank 0's with ``hooks``). Raises what loading raises."""
    if parallel.backend == "uni":
        return UniExecutor(args, hooks)
    if parallel.backend == "mp":
        from pagedserve.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(parallel, args, hooks)
    from pagedserve.executor.ray_executor import RayExecutor

    return RayExecutor(parallel, args, hooks)
