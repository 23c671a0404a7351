"""Executors: where an engine's workers run (``uni``: in this process; ``mp``: ranks 1..
as local processes; ``ray``: ranks 1.. as Ray actors)."""

from pagedserve.executor.multiproc import create_executor

__all__ = ["create_executor"]
