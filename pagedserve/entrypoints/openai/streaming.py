"""Streams of engine requests: merging several into one, framing outputs and errors as
server-sent events, and aborting a request whose client went away."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable

from fastapi import Request
from fastapi.responses import Response

from pagedserve.engine.request_stream import RequestStream
from pagedserve.entrypoints.openai.errors import engine_error
from pagedserve.outputs import RequestOutput

logger = logging.getLogger(__name__)


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield ``(prompt index, output)`` from several request streams as outputs arrive, until
    all finish. Raises the first stream error; leaving early aborts the unfinished ones."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out, None))
        except Exception as err:  # noqa: BLE001 - re-raised by the consumer below
            queue.put_nowait((i, None, err))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(streams)
    try:
        while remaining:
            i, out, err = await queue.get()
            if err is not None:
                raise err
            yield i, out
            if out.finished:
                remaining -= 1
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()



def sse(payload: str) -> str:
    """One server-sent event carrying a JSON payload (or ``[DONE]``)."""
    return f"data: {payload}\n\n"


def sse_error(err: Exception) -> str:
    """An error event in the middle of a stream (the body OpenAI's clients raise from)."""
    return sse(json.dumps(engine_error(err).body()))


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """Await ``work`` unless the client goes away first; then cancel it (which aborts its
    engine requests) and return an unsent 499."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        watcher.cancel()
    if task.cancelled():
        logger.info("client disconnected: request aborted")
        return Response(status_code=499)
    return task.result()
