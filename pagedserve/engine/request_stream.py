"""Per-request output streams of ``AsyncLLM`` (and ``DataParallelLLM``), and the errors a
stream or a new request raises.

A ``RequestStream`` keeps only its request's newest ``RequestOutput``: outputs are
cumulative, so a slow reader skips intermediate states but never loses text. The engine
thread hands it outputs through ``loop.call_soon_threadsafe``; only the loop thread reads it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Protocol

from pagedserve.outputs import RequestOutput


class EngineClosedError(RuntimeError):
    """The engine is shut down (or shutting down) and takes no new requests."""


class RequestAbortedError(RuntimeError):
    """The engine aborted the request (server shutdown); raised by ``RequestStream.get``."""


class EngineStepError(RuntimeError):
    """An engine step failed while the request was in flight; the request was dropped."""


class Aborter(Protocol):
    """What a ``RequestStream`` needs of its engine: ``abort(request_id)``."""

    def abort(self, request_id: str) -> None: ...


class RequestStream:
    """Outputs of one request, handed from the engine thread to an asyncio loop.

    Iterate it (``async for out in stream``) to get cumulative ``RequestOutput``s up to and
    including the finished one. ``get()`` raises ``RequestAbortedError`` or
    ``EngineStepError`` if the engine dropped the request. Leaving the iteration early (or
    cancelling the task) aborts the request; so does ``abort()``.
    """

    def __init__(self, request_id: str, engine: Aborter) -> None:
        self.request_id = request_id
        self._engine = engine
        self._latest: RequestOutput | BaseException | None = None
        self._event = asyncio.Event()
        self.finished = False

    def _put(self, item: RequestOutput | BaseException) -> None:
        """Called on the loop thread. An error sticks; an output replaces an older one."""
        if isinstance(self._latest, BaseException):
            return
        self._latest = item
        self._event.set()

    async def get(self) -> RequestOutput:
        """Wait for the newest output (cumulative). Raises what the engine reported."""
        await self._event.wait()
        self._event.clear()
        item, self._latest = self._latest, None
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        """Abort the request unless it already finished (thread-safe, idempotent)."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                yield await self.get()
        finally:
            self.abort()

