"""``/dashboard``: a live page of the KV block pool, the request queues and the last steps.

Routes (all relative, so the page works behind a proxy prefix):

- ``GET /dashboard``: the page (static files shipped in this package; no CDN). It loads
  without the API key and asks for it when the data endpoints answer 401.
- ``GET /dashboard/static/...``: its script, styles and the vendored uPlot 1.6.32 (MIT;
  ``npm pack uplot``: ``dist/uPlot.iife.min.js``, ``dist/uPlot.min.css``, ``LICENSE``).
- ``GET /dashboard/state``: one snapshot as JSON (``pagedserve.engine.snapshot``).
- ``GET /dashboard/events``: snapshots as Server-Sent Events (``data: {json}``), at most
  ``SnapshotHub.interval`` apart. A client that reads slowly skips snapshots: each one
  keeps only the newest, nothing queues.

With ``--api-key`` the two data endpoints need it (``Authorization: Bearer KEY``), as
``/v1`` does: they show request metadata. ``--disable-dashboard`` leaves all of it out.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles

from pagedserve.engine.async_engine import AsyncLLM
from pagedserve.engine.request_stream import EngineClosedError
from pagedserve.engine.snapshot import latency_percentiles, merge_snapshots, take_snapshot
from pagedserve.engine.timeline import LatencyWindow
from pagedserve.entrypoints.openai.errors import APIError

if TYPE_CHECKING:
    from pagedserve.engine.data_parallel import DataParallelLLM

logger = logging.getLogger(__name__)
STATIC = Path(__file__).parent / "static"
# Paths that show request metadata: they need the API key when one is set.
PROTECTED_PATHS = ("/dashboard/state", "/dashboard/events")


class _Listener:
    """One SSE client: the newest snapshot it has not sent yet."""

    def __init__(self) -> None:
        self.latest: str | None = None
        self.closed = False
        self.event = asyncio.Event()

    def put(self, payload: str | None) -> None:
        if payload is None:
            self.closed = True
        else:
            self.latest = payload
        self.event.set()


class SnapshotHub:
    """Takes one snapshot every ``interval`` seconds while anyone listens, and hands it to
    every listener; with nobody listening it takes none. When the engine closes (or a
    snapshot fails) every stream ends.

    Args:
        take: coroutine function returning a snapshot serialized as JSON text.
        interval: seconds between snapshots (0.25: at most 4 a second).
    """

    def __init__(self, take: Callable[[], Awaitable[str]], interval: float = 0.25) -> None:
        self.take = take
        self.interval = interval
        self.listeners: set[_Listener] = set()
        self._task: asyncio.Task | None = None

    async def _produce(self) -> None:
        loop = asyncio.get_running_loop()
        while self.listeners:
            start = loop.time()
            try:
                payload = await self.take()
            except EngineClosedError:
                payload = None
            except Exception:  # a bug: end the streams (clients reconnect) rather than hang
                logger.exception("dashboard snapshot failed")
                payload = None
            for listener in list(self.listeners):
                listener.put(payload)
            if payload is None:
                return
            await asyncio.sleep(max(0.0, self.interval - (loop.time() - start)))

    async def subscribe(self) -> AsyncIterator[str]:
        """Yield snapshots (newest only) until the engine closes or the caller leaves."""
        listener = _Listener()
        self.listeners.add(listener)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._produce())
        try:
            while True:
                await listener.event.wait()
                listener.event.clear()
                if listener.closed:
                    return
                yield listener.latest
        finally:
            self.listeners.discard(listener)


def add_dashboard_routes(app: FastAPI, engine: AsyncLLM | DataParallelLLM, model_name: str,
                         latency: LatencyWindow | None, api_key_required: bool) -> SnapshotHub:
    """Serve the dashboard from ``app``; ``latency`` (fed as a stat logger by the engine
    thread) gives the page's TTFT / TPOT / end-to-end percentiles. With
    ``api_key_required`` the page asks for the key before it first calls the data
    endpoints (no request is sent to fail with 401). Returns the hub."""

    async def take() -> str:
        # Each replica snapshots its own engine; the latency window lives here, fed by all.
        snap = merge_snapshots(await engine.run_between_steps_all(take_snapshot))
        snap["latency"] = latency_percentiles(latency)
        snap["model"] = model_name
        return json.dumps(snap, separators=(",", ":"))

    hub = SnapshotHub(take)
    app.mount("/dashboard/static", StaticFiles(directory=STATIC), name="dashboard-static")

    key_mode = "api-key-required" if api_key_required else "api-key-optional"
    html = (STATIC / "index.html").read_text().replace('content="api-key-optional"',
                                                       f'content="{key_mode}"')

    @app.get("/dashboard", include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse(html, headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/", include_in_schema=False)
    async def page_slash() -> RedirectResponse:
        # Relative, so a proxy prefix survives: the page's own URLs are relative to /dashboard.
        return RedirectResponse("../dashboard")

    @app.get("/dashboard/state", include_in_schema=False)
    async def state() -> Response:
        try:
            body = await take()
        except EngineClosedError as err:
            raise APIError(503, str(err)) from err
        return Response(body, media_type="application/json",
                        headers={"Cache-Control": "no-store"})

    @app.get("/dashboard/events", include_in_schema=False)
    async def events() -> StreamingResponse:
        async def stream() -> AsyncIterator[str]:
            async for payload in hub.subscribe():
                yield f"data: {payload}\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store",
                                          "X-Accel-Buffering": "no"})

    return hub
