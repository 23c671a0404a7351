"""Data parallelism (issue 15): replicas behind one engine interface, routed by load."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from dataclasses import replace

import httpx
import pytest
from conftest import free_port, wait_until

from pagedserve import LLM, SamplingParams
from pagedserve.args import EngineArgs
from pagedserve.engine.data_parallel import DataParallelLLM, replica_cpus
from pagedserve.engine.snapshot import merge_snapshots, take_snapshot
from pagedserve.metrics import PrometheusStatLogger

ARGS = EngineArgs(dtype="float32", skip_tokenizer_init=True, block_size=4, max_model_len=64,
                  num_gpu_blocks_override=64, max_num_seqs=8)
PROMPTS = [[1, 5 + i % 7, 9, 20 + i, 3 + i % 5] for i in range(32)]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _series(text: str, name: str) -> dict[str, float]:
    """``engine`` label -> sum of the samples of ``name`` (over its other labels); samples
    without an engine label are keyed ``""``."""
    out = {}
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            engine = re.search(r'engine="(\d+)"', line)
            key = engine.group(1) if engine else ""
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def test_replica_cpus_split_the_cores():
    cpus = sorted(replica_cpus(0, 1))
    halves = [replica_cpus(i, 2) for i in range(2)]
    if len(cpus) >= 2:
        assert not halves[0] & halves[1] and halves[0] | halves[1] <= set(cpus)
        assert len(halves[0]) == len(halves[1]) == len(cpus) // 2


def test_dp2_spreads_requests_and_matches_dp1(tiny_llama):
    path = str(tiny_llama[0])
    ref = LLM(path, **{k: getattr(ARGS, k) for k in (
        "dtype", "skip_tokenizer_init", "block_size", "max_model_len",
        "num_gpu_blocks_override", "max_num_seqs")})
    expected = [o.outputs[0].token_ids for o in ref.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)]

    stats = PrometheusStatLogger("tiny", 64, engine_indexes=range(2))
    dp = DataParallelLLM(replace(ARGS, model=path, data_parallel_size=2), stats)
    try:
        assert dp.engine.num_blocks == 64 and dp.is_running

        async def one(i: int) -> list[int]:
            final = None
            async for out in dp.generate({"prompt_token_ids": PROMPTS[i]}, PARAMS, f"r{i}"):
                final = out
            return final.outputs[0].token_ids

        async def main():
            return await asyncio.gather(*(one(i) for i in range(32)))

        got = asyncio.run(main())
        assert got == expected

        def done_per_engine():
            text = stats.render().decode()
            done = _series(text, "vllm:request_success_total")  # finished_reason="length"
            return done if sum(done.values()) == 32 else None

        done = wait_until(done_per_engine, 30, "both replicas' request counts")
        assert set(done) == {"0", "1"} and min(done.values()) >= 8  # routed to both
        tokens = wait_until(lambda: (t := _series(stats.render().decode(),
                                                  "vllm:generation_tokens_total"))
                            and sum(t.values()) == 32 * 6 and t, 30, "generation tokens")
        assert set(tokens) == {"0", "1"}
        # The dashboard's view: each replica snapshots its own pool between its steps.
        snaps = asyncio.run(dp.run_between_steps_all(take_snapshot))
        assert len(snaps) == 2 and all(s["kv_cache_stats"]["total_blocks"] == 64 for s in snaps)
        merged = merge_snapshots(snaps)
        assert [(p["replica"], p["num_blocks"]) for p in merged["pools"]] == [(0, 64), (1, 64)]
        assert merged["kv_cache_stats"]["total_blocks"] == 128
        assert merged["kv_cache_stats"]["used_blocks"] == 0 and merged["running"] == []
        assert merged["step"] == snaps[0]["step"] + snaps[1]["step"] > 0
        with pytest.raises(ValueError, match="max_tokens"):  # a replica's ValueError
            asyncio.run(dp.add_request("bad", {"prompt_token_ids": [1]},
                                       SamplingParams(max_tokens=100)))
        os.kill(dp.processes[1].pid, signal.SIGKILL)  # a replica dies: /health goes 503
        wait_until(lambda: not dp.is_running, 30, "is_running False after a replica died")
    finally:
        dp.shutdown()
    assert not dp.is_running


def test_serve_dp2_answers_with_per_replica_metrics_and_pools(tmp_path):
    """``pagedserve serve -dp 2`` (the bundled model) end to end, the dashboard on as by
    default: completions, ``/metrics`` labelled per engine, ``/dashboard/state`` one pool per
    replica."""
    port = free_port()
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", "--port", str(port),
             "-dp", "2", "--dtype", "float32", "--max-model-len", "256",
             "--num-gpu-blocks-override", "64",
             "--uvicorn-log-level", "warning"],
            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert proc.poll() is None, log_path.read_text()
        try:
            return httpx.get(url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(ready, 300, "the -dp 2 server to start", interval=0.3)
        with httpx.Client(base_url=url, timeout=120) as http:
            for prompt in PROMPTS[:4]:  # token ids
                r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3,
                                                       "temperature": 0, "ignore_eos": True})
                assert r.status_code == 200, r.text
                assert r.json()["usage"]["completion_tokens"] == 3
            done = wait_until(lambda: (d := _series(http.get("/metrics").text,
                                                    "vllm:request_success_total"))
                              and sum(d.values()) == 4 and d, 30, "4 successes in /metrics")
            assert set(done) <= {"0", "1"} and "" not in done
            snap = http.get("/dashboard/state").json()
            assert [(p["replica"], p["num_blocks"]) for p in snap["pools"]] == [(0, 64), (1, 64)]
            assert snap["kv_cache_stats"]["total_blocks"] == 128
    finally:
        proc.terminate()
        proc.wait(60)
