"""Peak resident memory (VmHWM) of a server answering the shared workload's first 16
requests (all sent at once, greedy, exact lengths), with its throughput: ``pagedserve
serve`` on the bundled Q4_1 model in each configuration given, and llama.cpp's
``llama-server`` on the same file with the same token capacity (``-np 16 -c`` = the pool
of the first ``--memory-budget`` run, its default 16-bit KV cache), run one after another.
The interpreter's own baseline (Python with torch, transformers and our HTTP stack
imported, before any weight) is measured apart.

    .venv/bin/python benchmarks/lean_memory.py --reps 2 --llama-server PATH/llama-server \\
        --config default= \\
        --config "lean=--memory-budget 750000000 --max-num-batched-tokens 512" \\
        --config "int8=--quantization int8 --memory-budget 750000000 --max-num-batched-tokens 512"

Each ``--config LABEL=ARGS`` adds one pagedserve run with those serve arguments (besides
``--max-num-seqs 16 --max-model-len 1024``); ``LABEL@DIR=ARGS`` runs the checkout in DIR
(another commit, for a before / after). With ``--reps N`` every server runs N times, in
rounds, and the medians are printed; the ratios are to the first configuration and to
llama-server.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from pagedserve.benchmarks.datasets import resolve_path, workload_samples
from pagedserve.benchmarks.serve import wait_server_started
from pagedserve.distributed.group import free_port
from pagedserve.model_loader.files import resolve_model_path

NUM_REQUESTS = 16
START_TIMEOUT = 600.0  # seconds
BASELINE_IMPORTS = ("import torch, transformers, fastapi, uvicorn; "
                    "import pagedserve.entrypoints.openai.api_server")


def resident(pid: int, field: str = "VmHWM") -> int:
    """A process's resident high-water mark (``VmHWM``) or resident memory now
    (``VmRSS``), bytes."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+) kB", status).group(1)) * 1024


def baseline_rss() -> int:
    """VmHWM of an interpreter that imported the serving stack, bytes."""
    code = BASELINE_IMPORTS + "; import re; print(re.search(r'VmHWM:\\s+(\\d+)', " \
        "open('/proc/self/status').read()).group(1))"
    return int(subprocess.check_output([sys.executable, "-c", code], text=True)) * 1024


def run_requests(send, samples) -> tuple[float, int]:
    """All samples at once through ``send(sample) -> output tokens``; (seconds, tokens)."""
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(samples)) as pool:
        tokens = sum(pool.map(send, samples))
    return time.perf_counter() - start, tokens


def serve_and_measure(cmd: list[str], port: int, send, samples, log: Path,
                      cwd: str | None = None) -> dict:
    """Start ``cmd`` (in ``cwd``), send the samples, and return its VmHWM, throughput and
    log."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        url = f"http://127.0.0.1:{port}"
        wait_server_started(proc, url, START_TIMEOUT, log.read_text)
        seconds, tokens = run_requests(lambda s: send(url, s), samples)
        return {"peak_rss": resident(proc.pid), "rss": resident(proc.pid, "VmRSS"),
                "tok_s": tokens / seconds, "log": log.read_text()}
    finally:
        proc.terminate()
        proc.wait(60)


def send_pagedserve(url: str, sample) -> int:
    body = {"model": "m", "prompt": sample.prompt_token_ids, "temperature": 0,
            "max_tokens": sample.expected_output_len, "ignore_eos": True}
    reply = httpx.post(url + "/v1/completions", json=body, timeout=START_TIMEOUT)
    reply.raise_for_status()
    return reply.json()["usage"]["completion_tokens"]


def send_llama(url: str, sample) -> int:
    body = {"prompt": sample.prompt_token_ids, "n_predict": sample.expected_output_len,
            "temperature": 0, "ignore_eos": True, "cache_prompt": False}
    reply = httpx.post(url + "/completion", json=body, timeout=START_TIMEOUT)
    reply.raise_for_status()
    return reply.json()["tokens_predicted"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", action="append", required=True, metavar="LABEL=ARGS")
    parser.add_argument("--llama-server", default=None, help="llama-server binary (optional)")
    parser.add_argument("--model", default=None, help="GGUF file (default: the bundled)")
    parser.add_argument("--reps", type=int, default=1,
                        help="rounds over every server (medians are printed)")
    args = parser.parse_args()
    model = str(resolve_model_path(args.model))
    samples = workload_samples(resolve_path("workload", None))[:NUM_REQUESTS]
    out = Path(tempfile.mkdtemp(prefix="lean_memory_"))
    base = baseline_rss()
    print(f"interpreter baseline ({BASELINE_IMPORTS}): {base / 2**20:.0f} MiB")
    runs: dict[str, list[dict]] = {}
    llama_pool = None
    for rep in range(args.reps):
        for config in args.config:
            label, _, extra = config.partition("=")
            label, _, checkout = label.partition("@")
            port = free_port()
            cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", model,
                   "--port", str(port), "--served-model-name", "m", "--max-num-seqs",
                   str(NUM_REQUESTS), "--max-model-len", "1024", "--uvicorn-log-level",
                   "warning", *shlex.split(extra)]
            r = serve_and_measure(cmd, port, send_pagedserve, samples,
                                  out / f"{label}_{rep}.log", checkout or None)
            r["pool"] = int(re.search(r"= (\d+) tokens", r["log"]).group(1))
            if llama_pool is None and "--memory-budget" in extra:
                llama_pool = r["pool"]
            runs.setdefault(label, []).append(r)
        if args.llama_server:
            pool = llama_pool or runs[next(iter(runs))][0]["pool"]
            port = free_port()
            cmd = [args.llama_server, "-m", model, "-t", str(len(os.sched_getaffinity(0))),
                   "-np", str(NUM_REQUESTS), "-c", str(pool), "--kv-unified", "--port",
                   str(port)]
            r = serve_and_measure(cmd, port, send_llama, samples, out / f"llama_{rep}.log")
            r["pool"] = pool
            runs.setdefault("llama-server", []).append(r)
    report(runs, base, "llama-server" if args.llama_server else None)
    print(f"(logs: {out})")


def report(runs: dict[str, list[dict]], base: int, llama: str | None) -> None:
    """One line per server: the medians over its runs."""
    med = {label: {key: statistics.median(r[key] for r in rs)
                   for key in ("peak_rss", "rss", "tok_s", "pool")} for label, rs in runs.items()}
    first = next(iter(med))
    print(f"{'server':<16}{'pool tokens':>12}{'VmHWM MiB':>11}{'- baseline':>11}"
          f"{'/ llama':>9}{'VmRSS after':>12}{'tok/s':>8}{'/ first':>9}")
    for label, m in med.items():
        above = m["peak_rss"] - (0 if label == llama else base)
        vs_llama = f"{above / med[llama]['peak_rss']:.2f}x" if llama else "-"
        print(f"{label:<16}{m['pool']:>12.0f}{m['peak_rss'] / 2**20:>11.0f}"
              f"{above / 2**20:>11.0f}{vs_llama:>9}{m['rss'] / 2**20:>12.0f}{m['tok_s']:>8.1f}"
              f"{m['tok_s'] / med[first]['tok_s']:>8.2f}x")


if __name__ == "__main__":
    main()
