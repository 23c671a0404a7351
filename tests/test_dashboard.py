"""The live /dashboard: its data endpoints over HTTP, and the page in a real browser.

One real `pagedserve serve` (the bundled SmolLM2, with --api-key) for the module. The
browser is Debian's headless Chromium driven by Playwright (`bash setup.sh test` installs
both; without them the browser tests skip). The pool size the page must draw comes from
/metrics (`vllm:cache_config_info`), and the used-block count the page computes from the
block states is compared with the engine's own `kv_cache_stats()` of the same snapshot.
"""

import asyncio
import base64
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import free_port, wait_until
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.engine.request_stream import EngineClosedError
from pagedserve.entrypoints.openai.app import build_app
from pagedserve.entrypoints.openai.dashboard import SnapshotHub
from pagedserve.entrypoints.openai.serving_engine import ServingContext

API_KEY = "dash-key-42"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "SmolLM2-135M-Instruct"
CHROMIUM = "/usr/bin/chromium"
# Without these, Chromium keeps trying to reach Google's services on a closed network.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
START_TIMEOUT = 600  # seconds; the shared machine can be very slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A running server: its base URL."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("dashboard") / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", "--port", str(port),
             "--dtype", "float32", "--api-key", API_KEY, "--max-model-len", "1024",
             "--uvicorn-log-level", "warning"],
            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log_path.read_text()}")
        try:
            return httpx.get(url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(ready, START_TIMEOUT, "the server to start", interval=0.3)
        yield url
    finally:
        proc.terminate()
        proc.wait(60)


@pytest.fixture(scope="module")
def num_gpu_blocks(server) -> int:
    """The pool size as /metrics reports it (vLLM's cache_config_info label)."""
    text = httpx.get(server + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return int(families["vllm:cache_config_info"].samples[0].labels["num_gpu_blocks"])


def _state(server) -> dict:
    response = httpx.get(server + "/dashboard/state", headers=AUTH, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


class LongRequest:
    """A streamed completion that runs until ``stop()`` closes it (the server then aborts
    it); ``request_id`` is known once its first chunk arrived."""

    def __init__(self, server: str) -> None:
        self.request_id: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(server,), daemon=True)
        self._thread.start()

    def _run(self, server: str) -> None:
        # ~60 prompt tokens: full blocks, which stay cached (free) once it ends.
        body = {"model": MODEL, "prompt": "Once upon a time, in a small village, " * 6,
                "max_tokens": 600, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server + "/v1/completions", json=body, headers=AUTH,
                          timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: {") and self.request_id is None:
                    self.request_id = json.loads(line[6:])["id"]
                if self._stop.is_set():
                    return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)


# -- HTTP -------------------------------------------------------------------------------


def test_page_and_static_files_need_no_key(server):
    page = httpx.get(server + "/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'content="api-key-required"' in page.text  # the page asks for the key first
    for name in ("dashboard.js", "dashboard.css", "uPlot.iife.min.js", "uPlot.min.css"):
        assert httpx.get(f"{server}/dashboard/static/{name}").status_code == 200, name
    # Relative URLs only (a proxy prefix survives), nothing from another host.
    js = httpx.get(f"{server}/dashboard/static/dashboard.js").text
    urls = re.findall(r'(?:src|href)="([^"]+)"', page.text) + re.findall(r'fetch\("([^"]+)"', js)
    assert "dashboard/events" in urls and "dashboard/static/dashboard.js" in urls
    assert not [u for u in urls if u.startswith(("/", "http")) or "//" in u], urls
    # Relative redirect: the page's relative URLs need it at /dashboard, even behind a prefix.
    slash = httpx.get(server + "/dashboard/")
    assert slash.status_code == 307 and slash.headers["location"] == "../dashboard"


@pytest.mark.parametrize("path", ["/dashboard/state", "/dashboard/events"])
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}])
def test_data_needs_the_key(server, path, headers):
    response = httpx.get(server + path, headers=headers)
    assert response.status_code == 401
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_state_is_the_whole_pool(server, num_gpu_blocks):
    snap = _state(server)
    (pool,) = snap["pools"]
    state = np.frombuffer(base64.b64decode(pool["state"]), np.uint8)
    filled = np.frombuffer(base64.b64decode(pool["filled"]), pool["filled_dtype"])
    assert pool["num_blocks"] == state.size == filled.size == num_gpu_blocks
    assert snap["model"] == MODEL
    assert snap["kv_cache_stats"]["total_blocks"] == num_gpu_blocks
    assert set(snap["latency"]) == {"window", "ttft", "tpot", "e2e"}


def test_events_at_most_four_a_second(server):
    """Snapshots arrive as SSE, each a full state, in step order, at most 4 a second (a
    slow machine only sends fewer)."""
    steps, start = [], time.monotonic()
    with httpx.stream("GET", server + "/dashboard/events", headers=AUTH, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                steps.append(json.loads(line[6:])["step"])
            if len(steps) == 3:
                break
    elapsed = time.monotonic() - start
    assert steps == sorted(steps)
    assert len(steps) <= 1 + 4 * elapsed


def test_slow_listener_gets_only_the_newest():
    """The hub hands each listener the newest snapshot: one that did not read while three
    were taken gets the third, not a queue."""
    async def main():
        produced: asyncio.Queue[str] = asyncio.Queue()
        taken = []

        async def take() -> str:
            taken.append(await produced.get())
            return taken[-1]

        hub = SnapshotHub(take, interval=0)
        events = hub.subscribe()
        produced.put_nowait("s1")
        first = await anext(events)
        for s in ("s2", "s3", "s4"):
            produced.put_nowait(s)
        while len(taken) < 4:
            await asyncio.sleep(0.01)
        second = await anext(events)
        await events.aclose()
        return first, second, hub.listeners

    assert asyncio.run(main()) == ("s1", "s4", set())


@pytest.mark.parametrize("error", [EngineClosedError("closing"), RuntimeError("a bug")])
def test_streams_end_when_snapshots_fail(error):
    async def take() -> str:
        raise error

    async def main():
        hub = SnapshotHub(take, interval=0)
        return [s async for s in hub.subscribe()], hub.listeners

    assert asyncio.run(main()) == ([], set())


def test_disable_dashboard():
    ctx = ServingContext(engine=None, served_model_name="m", model_aliases={"m"},
                         model_root="m", tokenizer=None, max_model_len=8)
    client = TestClient(build_app(ctx, enable_dashboard=False))
    for path in ("/dashboard", "/dashboard/state", "/dashboard/events",
                 "/dashboard/static/dashboard.js"):
        assert client.get(path).status_code == 404, path
    ctx.executor.shutdown()


# -- the page in a browser ---------------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium; Playwright's launch() gives it a fresh temporary profile
    (--user-data-dir) of its own."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="bash setup.sh test")
    if not Path(CHROMIUM).exists() or shutil.which(CHROMIUM) is None:
        pytest.skip("no Chromium: apt-get install -y chromium (bash setup.sh test, as root)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


def _page_view(page) -> dict:
    """What the page shows now, and the snapshot it drew it from."""
    return page.evaluate("""() => ({
        step: dashboard.snapshot.step,
        shownStep: Number(document.getElementById('step').textContent),
        used: Number(document.querySelector('#pool-0 [data-total=used]').textContent),
        engineUsed: dashboard.snapshot.kv_cache_stats.used_blocks,
        running: [...document.querySelectorAll('#running tbody tr')]
                 .map(tr => tr.dataset.requestId),
    })""")


def test_page_follows_the_engine(server, browser, num_gpu_blocks):
    """The page loads without console errors, asks for the key, draws one cell per block,
    and its used count (computed by the page from the block states) equals the engine's
    kv_cache_stats() of the same step while a request runs, then returns to 0 once the
    request has left the running list (its cached blocks are free, not used)."""
    page = browser.new_page(viewport={"width": 1300, "height": 1000})
    problems = []
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.goto(server + "/dashboard")
    page.wait_for_selector("#key-form", state="visible")
    page.fill("#key", API_KEY)
    page.click("#key-form button")
    page.wait_for_function("document.body.dataset.step !== undefined", timeout=60_000)
    assert page.get_attribute("#pool-0 canvas", "data-cells") == str(num_gpu_blocks)

    request = LongRequest(server)
    try:
        wait_until(lambda: request.request_id, 120, "the first streamed chunk")
        seen = {}

        def observed_running() -> bool:
            view = _page_view(page)
            assert view["used"] == view["engineUsed"], view
            assert view["shownStep"] == view["step"], view
            if request.request_id in view["running"]:
                assert view["used"] > 0, view
                seen[view["step"]] = view["used"]
            return len(seen) >= 3

        wait_until(observed_running, 120, "three snapshots of the running request")
        # Hovering the request's first block names it; 60 prompt tokens fill that block.
        box = page.evaluate("""(rid) => {
            const pool = dashboard.pools[0], {cell, cols} = pool.layout;
            const row = dashboard.snapshot.running.find(r => r.id === rid);
            const b = row.blocks[0];
            return {x: (b % cols) * cell + cell / 2, y: Math.floor(b / cols) * cell + cell / 2};
        }""", request.request_id)
        page.hover("#pool-0 canvas", position=box)
        tip = page.text_content("#tooltip")
        assert f"holders {request.request_id}" in tip and "ref count 1" in tip, tip
        assert "slots filled 16 / 16" in tip, tip
    finally:
        request.stop()

    def drained() -> dict | None:
        view = _page_view(page)
        assert view["used"] == view["engineUsed"], view
        done = request.request_id not in view["running"] and view["used"] == 0
        return view if done else None

    view = wait_until(drained, 120, "the request to leave and its blocks to be freed")
    # Its full blocks stay in the prefix cache: free, yet not blank (and not counted used).
    cached = page.evaluate("dashboard.snapshot.kv_cache_stats.cached_blocks")
    assert cached >= 3, view
    assert problems == []
    page.close()
