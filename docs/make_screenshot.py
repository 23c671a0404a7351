"""Redraw docs/dashboard.png: the dashboard of a server under load, in headless Chromium.

    python docs/make_screenshot.py            # needs playwright and /usr/bin/chromium

A small pool (1024 blocks), prompts sharing a long system prefix (prefix cache), n=2
samples (shared blocks), long prompts in small steps (chunked prefill) and more requests
than --max-num-seqs (a waiting queue), so that every state shows.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from playwright.sync_api import sync_playwright

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
PREFIX = "You are a helpful assistant who answers in full sentences. " * 12


def traffic(url: str, i: int) -> None:
    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 120 + 20 * i, "ignore_eos": True,
            "n": 2 if i % 3 == 0 else 1, "temperature": 0.8,
            "prompt": PREFIX + f"Question {i}: tell me about the number {i}. " * (1 + i % 4)}
    httpx.post(url + "/v1/completions", json=body, timeout=600)


def main() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "pagedserve.entrypoints.cli", "serve",
                               "--port", str(port), "--dtype", "float32",
                               "--num-gpu-blocks-override", "1024", "--max-num-seqs", "8",
                               "--max-num-batched-tokens", "128", "--max-model-len", "1024",
                               "--uvicorn-log-level", "warning"])
    try:
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        threads = [threading.Thread(target=traffic, args=(url, i), daemon=True)
                   for i in range(12)]
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium",
                                        args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(url + "/dashboard")
            for t in threads:
                t.start()
                time.sleep(0.5)
            # Enough steps for the charts to say something (a loaded machine takes minutes).
            page.wait_for_function("dashboard.snapshot && dashboard.snapshot.step >= 80",
                                   timeout=600_000)
            out = Path(__file__).with_name("dashboard.png")
            page.screenshot(path=str(out), full_page=True)
            print(f"wrote {out}")
            browser.close()
    finally:
        server.terminate()
        server.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
