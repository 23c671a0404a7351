"""``--memory-budget`` (lean memory, issue 31): a server given a budget sizes its KV pool
from what the process holds after loading and the activation peak of its largest step,
stays within the budget while it serves, and makes requests that do not fit the pool at
once wait or be preempted, never fail (their tokens the same as each alone); a budget
below the loaded model refuses to start, naming the numbers."""

from __future__ import annotations

import concurrent.futures
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import free_port, stop_process, wait_server_ready

from pagedserve.cpu_ops import cpu_ops_available

pytestmark = pytest.mark.skipif(not cpu_ops_available(), reason="C++ CPU kernels unavailable")

MAX_MODEL_LEN = 128
# One block of K and V: 30 layers x 16 tokens x 3 KV heads x 64 channels x 2, float32.
PER_BLOCK = 2 * 30 * 16 * 3 * 64 * 4
START_TIMEOUT = 600  # seconds; the shared 2-core machine can be very slow under load


class BudgetServer:
    """``pagedserve serve`` of the bundled model (its default GGUF blocks, float32) with
    ``--memory-budget budget``."""

    def __init__(self, tmp: Path, budget: int) -> None:
        self.budget, self.port = budget, free_port()
        self.log_path = tmp / f"server_{budget}.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", "--port",
                 str(self.port), "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
                 "--memory-budget", str(budget), "--max-num-seqs", "8",
                 "--max-num-batched-tokens", "256", "--uvicorn-log-level", "warning"],
                stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self.url = f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_ready(self) -> None:
        wait_server_ready(self.proc, self.url, self.log, START_TIMEOUT)
        self.model = httpx.get(self.url + "/v1/models", timeout=10).json()["data"][0]["id"]

    def sizing(self) -> tuple[int, int, int]:
        """(held after loading or kept for serving, activation peak, KV blocks) from the
        start-up log."""
        held, peak = map(int, re.search(r"memory budget \d+ bytes: (\d+) held after loading or "
                                        r"kept for serving, activation peak (\d+)",
                                        self.log()).groups())
        blocks = int(re.search(r"KV cache: (\d+) blocks x 16 tokens", self.log()).group(1))
        return held, peak, blocks

    def peak_rss(self) -> int:
        """The server process's resident high-water mark (``VmHWM``), bytes."""
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024

    def complete(self, prompt: str) -> dict:
        body = {"model": self.model, "prompt": prompt, "max_tokens": 64, "temperature": 0,
                "ignore_eos": True}
        reply = httpx.post(self.url + "/v1/completions", json=body, timeout=START_TIMEOUT)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]


def metric(server: BudgetServer, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    values = re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    return sum(float(v) for v in values)


def test_budget_below_the_loaded_model_refuses_to_start(tmp_path):
    server = BudgetServer(tmp_path, 50 << 20)
    try:
        assert server.proc.wait(START_TIMEOUT) != 0
    finally:
        stop_process(server.proc)
    assert re.search(r"--memory-budget 50 MiB does not hold the loaded model: the process "
                     r"holds \d+ MiB after loading \(weights \d+ MiB, 32 MiB kept for serving",
                     server.log())


def test_budget_sizes_the_pool_and_requests_beyond_it_wait(tmp_path):
    # A generous budget first: the pool is what the budget leaves, in whole blocks.
    server = BudgetServer(tmp_path, 1 << 30)
    try:
        server.wait_ready()
        held, peak, blocks = server.sizing()
    finally:
        stop_process(server.proc)
    assert blocks == ((1 << 30) - held - peak) // PER_BLOCK
    assert held < 1 << 30 and blocks > 500

    # Then a budget that leaves ~20 blocks (320 tokens; a restart's numbers differ by a few
    # MiB): 8 requests of ~77 tokens (5 blocks) each cannot all hold their KV cache at once.
    budget = held + peak + 20 * PER_BLOCK + (2 << 20)
    server = BudgetServer(tmp_path, budget)
    try:
        server.wait_ready()
        held2, peak2, blocks = server.sizing()
        assert blocks == (budget - held2 - peak2) // PER_BLOCK and 8 <= blocks <= 36
        prompts = [f"Story {i}: once upon a time, in a village by the sea," for i in range(8)]
        alone = [server.complete(p) for p in prompts]
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(server.complete, prompts))
        assert [c["text"] for c in together] == [c["text"] for c in alone]
        assert all(c["finish_reason"] == "length" for c in together)
        assert metric(server, "vllm:num_preemptions_total") > 0
        assert server.peak_rss() <= budget
    finally:
        stop_process(server.proc)
