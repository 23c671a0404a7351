"""What one open /dashboard costs the server: output throughput with and without it.

Starts one `pagedserve serve` (extra arguments after `--` go to it), then runs the same
batch of completions (all at once, greedy, `ignore_eos`) in alternating rounds: with no
dashboard, then with one client reading `/dashboard/events` as the page does (every
snapshot parsed), and so on. Prints both output throughputs (median over rounds), their
ratio, the CPU flags, and what the snapshots cost the engine thread (``snapshot_seconds``,
measured by the engine: a figure the machine's noise moves far less than throughput). Alternating rounds in one run keep the comparison fair on a
shared, noisy machine.

    python benchmarks/dashboard_cost.py --rounds 3 --num-requests 16 --max-tokens 64
    python benchmarks/dashboard_cost.py -- --dtype float32 --max-num-seqs 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time

import httpx

from pagedserve.config import cpu_flags

FLAGS_SHOWN = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")


def start_server(extra: list[str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "pagedserve.entrypoints.cli", "serve",
                             "--port", str(port), "--uvicorn-log-level", "warning", *extra])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise SystemExit("the server did not start in 900 s")


async def watch_dashboard(client: httpx.AsyncClient, url: str, stop: asyncio.Event
                          ) -> list[float]:
    """Read /dashboard/events until ``stop``; returns each snapshot's cost to the engine
    thread (``snapshot_seconds``)."""
    costs = []
    async with client.stream("GET", url + "/dashboard/events", timeout=None) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                costs.append(json.loads(line[6:])["snapshot_seconds"])
            if stop.is_set():
                break
    return costs


async def one_round(url: str, args: argparse.Namespace, dashboard: bool
                    ) -> tuple[float, float, list[float]]:
    """Output tokens/s of one batch, its duration (s), and the costs of the snapshots the
    dashboard client read."""
    async with httpx.AsyncClient(timeout=None) as client:
        stop = asyncio.Event()
        watcher = (asyncio.create_task(watch_dashboard(client, url, stop)) if dashboard
                   else None)
        body = {"model": args.model_name, "max_tokens": args.max_tokens, "temperature": 0,
                "ignore_eos": True}
        start = time.perf_counter()
        replies = await asyncio.gather(*(
            client.post(url + "/v1/completions",
                        json={**body, "prompt": f"Request {i}: tell me about the number {i}."})
            for i in range(args.num_requests)))
        elapsed = time.perf_counter() - start
        stop.set()
        costs = await watcher if watcher is not None else []
    tokens = sum(r.raise_for_status().json()["usage"]["completion_tokens"] for r in replies)
    return tokens / elapsed, elapsed, costs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each kind")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--model-name", default="SmolLM2-135M-Instruct")
    parser.add_argument("server_args", nargs="*", help="after --: `pagedserve serve` flags")
    args = parser.parse_args()
    proc, url = start_server(args.server_args)
    results: dict[bool, list[float]] = {False: [], True: []}
    costs, open_time = [], 0.0
    try:
        asyncio.run(one_round(url, args, False))  # warm-up, not counted
        for r in range(args.rounds):
            for dashboard in (False, True):
                tps, elapsed, round_costs = asyncio.run(one_round(url, args, dashboard))
                results[dashboard].append(tps)
                extra = ""
                if dashboard:
                    costs += round_costs
                    open_time += elapsed
                    extra = f", {len(round_costs)} snapshots read"
                print(f"round {r + 1}, dashboard {'open' if dashboard else 'closed'}: "
                      f"{tps:.1f} output tok/s{extra}", flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
    closed, opened = (statistics.median(results[k]) for k in (False, True))
    flags = " ".join(f for f in FLAGS_SHOWN if f in cpu_flags()) or "none of " + ",".join(
        FLAGS_SHOWN)
    print(f"CPU flags: {flags}")
    print(f"no dashboard:       {closed:.1f} output tok/s (median of {args.rounds})")
    print(f"one dashboard open: {opened:.1f} output tok/s (median of {args.rounds})")
    print(f"cost: {100 * (1 - opened / closed):.1f}% of throughput")
    print(f"snapshots: {len(costs)}, {1000 * statistics.mean(costs):.2f} ms each on the engine "
          f"thread (max {1000 * max(costs):.2f}): {100 * sum(costs) / open_time:.2f}% of the "
          f"time the dashboard was open")
    return 0


if __name__ == "__main__":
    sys.exit(main())
