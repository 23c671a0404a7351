"""``pagedserve bench serve``: online serving benchmark against a running server.

Sends the dataset's requests (see ``datasets.py``; token-id prompts, greedy,
``ignore_eos`` by default so output lengths are exact) to an OpenAI-compatible
``/v1/completions`` endpoint with streaming, at ``--request-rate`` requests/s (Poisson
arrivals, or gamma with ``--burstiness``; ``inf`` sends all at once), at most
``--max-concurrency`` in flight. Prints, vLLM-style, TTFT (time to first token), TPOT
(time per output token after the first), ITL (gap between streamed chunks) and
end-to-end latency (mean, median, p99, in ms), request and token throughput.
``--plot FILE.png`` draws a timeline of the run (needs matplotlib: the ``bench`` extra).

Example::

    pagedserve serve --port 8000 &
    pagedserve bench serve --port 8000 --dataset-name workload --request-rate 4 --plot run.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
from tqdm import tqdm

from pagedserve.benchmarks import datasets

METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                 "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


@dataclass
class RequestResult:
    """Timestamps (``time.perf_counter`` seconds) of one streamed request.

    ``chunk_times`` are the arrivals of the chunks that carried output text; a chunk may
    carry several tokens. ``output_tokens`` is the server's ``completion_tokens`` when it
    reports usage, else the number of such chunks.
    """

    prompt_len: int
    expected_output_len: int
    start: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    end: float = 0.0
    output_tokens: int = 0
    success: bool = False
    error: str = ""

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def e2el(self) -> float:
        return self.end - self.start

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first, or None with a single token."""
        if self.output_tokens < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.output_tokens - 1)


def compute_metrics(results: list[RequestResult], duration: float) -> dict:
    """Figures of a run that lasted ``duration`` seconds: counts, throughputs, and for each
    of TTFT, TPOT, ITL and E2EL the mean, median and p99 in milliseconds.

    Worked example: sent at 0.0, chunks at 0.5, 0.6, 0.8 (3 tokens), stream closed at 0.8:
    TTFT 500 ms, ITLs 100 and 200 ms, TPOT (0.8 - 0.5) / 2 = 150 ms, E2EL 800 ms.
    """
    ok = [r for r in results if r.success and r.chunk_times]
    values = {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "itl": [x for r in ok for x in r.itls],
        "e2el": [r.e2el for r in ok],
    }
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    m = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": output_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / duration
        if duration > 0 else 0.0,
        "max_concurrent_requests": max_concurrency(ok),
    }
    for name, v in values.items():
        arr = np.asarray(v, dtype=float) * 1000.0
        m[f"mean_{name}_ms"] = float(arr.mean()) if arr.size else 0.0
        m[f"median_{name}_ms"] = float(np.median(arr)) if arr.size else 0.0
        m[f"p99_{name}_ms"] = float(np.percentile(arr, 99)) if arr.size else 0.0
    return m


def max_concurrency(results: list[RequestResult]) -> int:
    """Most requests in flight at once (from their start and end times)."""
    events = sorted([(r.start, 1) for r in results] + [(r.end, -1) for r in results],
                    key=lambda e: (e[0], e[1]))
    peak = now = 0
    for _, delta in events:
        now += delta
        peak = max(peak, now)
    return peak


def print_report(m: dict) -> None:
    def row(label: str, value) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        print(f"{label:<40}{text:>10}")

    print("{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="))
    row("Successful requests:", m["completed"])
    if m["failed"]:
        row("Failed requests:", m["failed"])
    row("Benchmark duration (s):", m["duration"])
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Request throughput (req/s):", m["request_throughput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Total token throughput (tok/s):", m["total_token_throughput"])
    row("Max concurrent requests:", m["max_concurrent_requests"])
    for name in METRICS:
        print("{s:{c}^50}".format(s=f" {METRIC_TITLES[name]} ", c="-"))
        upper = name.upper()
        row(f"Mean {upper} (ms):", m[f"mean_{name}_ms"])
        row(f"Median {upper} (ms):", m[f"median_{name}_ms"])
        row(f"P99 {upper} (ms):", m[f"p99_{name}_ms"])
    print("=" * 50)


# -- the client -------------------------------------------------------------------------


def arrival_offsets(num: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (seconds from the start): gamma-distributed gaps of mean 1/rate (shape
    ``burstiness``; 1 = Poisson process); all zero for an infinite rate."""
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("request_rate and burstiness must be > 0; got "
                         f"{request_rate} and {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * num
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num)
    gaps[0] = 0.0  # the first request goes at once
    return np.cumsum(gaps).tolist()


async def send_request(client, url: str, body: dict, result: RequestResult) -> RequestResult:
    """POST one streaming completion and record when each text chunk arrives."""
    result.start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"])
                    return result
                for choice in chunk.get("choices") or []:
                    if choice.get("text"):
                        result.chunk_times.append(now)
                        break
                if usage := chunk.get("usage"):
                    result.output_tokens = usage.get("completion_tokens") or 0
        result.end = time.perf_counter()
        if not result.output_tokens:
            result.output_tokens = len(result.chunk_times)
        result.success = bool(result.chunk_times)
        if not result.success:
            result.error = "no output text streamed"
    except Exception as e:  # noqa: BLE001 - a failed request is a figure, not a crash
        result.error = f"{type(e).__name__}: {e}"
    return result


def request_body(model: str, sample: datasets.SampleRequest, ignore_eos: bool) -> dict:
    return {"model": model, "prompt": sample.prompt_token_ids,
            "max_tokens": sample.expected_output_len, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}


def wait_server_started(proc: subprocess.Popen, url: str, timeout: float,
                        log: Callable[[], str]) -> None:
    """Poll ``url + "/health"`` until the server that ``proc`` started answers 200.

    Raises RuntimeError, with the server's ``log()``, if the process exits or ``timeout``
    seconds pass first (for benchmarks and tests that start their own servers)."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server not ready after {timeout} s:\n{log()}")


async def wait_ready(client, base_url: str, timeout: float) -> list[str]:
    """Poll ``GET /v1/models`` until the server answers; returns the model ids."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            resp = await client.get(f"{base_url}/v1/models")
            resp.raise_for_status()
            return [m["id"] for m in resp.json().get("data", [])]
        except Exception as e:  # not up yet
            if time.monotonic() >= deadline:
                raise ValueError(f"no server answers at {base_url} ({type(e).__name__}: {e})"
                                 ) from e
            await asyncio.sleep(0.5)


async def benchmark(args: argparse.Namespace, samples: list[datasets.SampleRequest],
                    base_url: str, model: str | None) -> tuple[list[RequestResult], float, str]:
    try:
        import httpx
    except ImportError as e:
        raise ValueError("bench serve needs httpx: pip install 'pagedserve[bench]'") from e

    headers = {}
    if api_key := (args.api_key or os.environ.get("OPENAI_API_KEY")):
        headers["Authorization"] = f"Bearer {api_key}"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits,
                                 headers=headers) as client:
        models = await wait_ready(client, base_url, args.ready_timeout)
        model = model or (models[0] if models else None)
        if model is None:
            raise ValueError("the server lists no model; pass --model")
        url = base_url + args.endpoint
        for i in range(args.num_warmups):  # untimed; fails loudly if the endpoint is wrong
            warm = datasets.SampleRequest(samples[i % len(samples)].prompt_token_ids, 4)
            r = await send_request(client, url, request_body(model, warm, True),
                                   RequestResult(warm.prompt_len, 4))
            if not r.success:
                raise ValueError(f"warm-up request to {url} failed: {r.error}")
        offsets = arrival_offsets(len(samples), args.request_rate, args.burstiness, args.seed)
        limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        bar = tqdm(total=len(samples), desc="Requests", disable=args.disable_tqdm)

        async def one(sample: datasets.SampleRequest, at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            result = RequestResult(sample.prompt_len, sample.expected_output_len)
            body = request_body(model, sample, args.ignore_eos)
            if limit is None:
                await send_request(client, url, body, result)
            else:
                async with limit:
                    await send_request(client, url, body, result)
            bar.update(1)
            return result

        t0 = time.perf_counter()
        with bar:
            results = await asyncio.gather(*(one(s, at) for s, at in zip(samples, offsets)))
        duration = time.perf_counter() - t0
    for r in results:  # times relative to the start of the run
        r.start -= t0
        r.end -= t0
        r.chunk_times = [t - t0 for t in r.chunk_times]
    return list(results), duration, model


def plot(results: list[RequestResult], path: str, title: str) -> None:
    """Timeline of a run: each request's wait-for-first-token and decode spans; requests in
    flight and output tokens/s over time; TTFT and ITL against time."""
    try:
        import matplotlib
    except ImportError as e:
        raise ValueError("--plot needs matplotlib: pip install 'pagedserve[bench]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = sorted((r for r in results if r.success), key=lambda r: r.start)
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(10, 11), sharex=True)
    for i, r in enumerate(ok):
        ax1.plot([r.start, r.chunk_times[0]], [i, i], color="tab:orange", lw=2)
        ax1.plot([r.chunk_times[0], r.end], [i, i], color="tab:blue", lw=2)
    ax1.set_ylabel("request (by send time)")
    ax1.set_title(f"{title}\norange: sent -> first token (TTFT), blue: decoding")
    end = max((r.end for r in ok), default=1.0)
    grid = np.linspace(0.0, end, 400)
    in_flight = [sum(1 for r in ok if r.start <= t < r.end) for t in grid]
    ax2.step(grid, in_flight, where="post", color="tab:purple")
    ax2.set_ylabel("requests in flight", color="tab:purple")
    width = max(end / 50, 0.25)
    edges = np.arange(0.0, end + width, width)
    times, weights = [], []
    for r in ok:  # spread each request's tokens over its chunks
        per_chunk = r.output_tokens / len(r.chunk_times)
        times += r.chunk_times
        weights += [per_chunk] * len(r.chunk_times)
    counts, _ = np.histogram(times, bins=edges, weights=weights)
    twin = ax2.twinx()
    twin.bar(edges[:-1], counts / width, width=width, align="edge", alpha=0.3, color="tab:green")
    twin.set_ylabel("output tokens/s", color="tab:green")
    ax3.scatter([r.start for r in ok], [r.ttft * 1000 for r in ok], s=12, label="TTFT (at send)",
                color="tab:orange")
    itl_t = [t for r in ok for t in r.chunk_times[1:]]
    itl_v = [x * 1000 for r in ok for x in r.itls]
    ax3.scatter(itl_t, itl_v, s=2, alpha=0.4, label="ITL (at arrival)", color="tab:blue")
    ax3.set_yscale("log")
    ax3.set_ylabel("ms")
    ax3.set_xlabel("time since start (s)")
    ax3.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- command ----------------------------------------------------------------------------


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default=None,
                        help="server URL, e.g. http://127.0.0.1:8000 (default: --host/--port)")
    parser.add_argument("--host", default="127.0.0.1", help="server host")
    parser.add_argument("--port", type=int, default=8000, help="server port")
    parser.add_argument("--endpoint", default="/v1/completions", help="completions path")
    parser.add_argument("--model", default=None,
                        help="model name in the API (default: the server's first model)")
    parser.add_argument("--tokenizer", default=None,
                        help="model path or name whose tokenizer builds the prompts "
                             "(default: --model, else the bundled model)")
    parser.add_argument("--api-key", default=None, help="bearer token (or $OPENAI_API_KEY)")
    datasets.add_dataset_args(parser)
    parser.add_argument("--seed", type=int, default=0, help="seed of sampling and arrivals")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="drop requests longer than this (prompt + output)")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests per second (inf: all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="shape of the gamma-distributed gaps (1: Poisson arrivals)")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="most requests in flight (default: no limit)")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="generate exactly the expected output lengths")
    parser.add_argument("--num-warmups", type=int, default=1,
                        help="untimed short requests before the run")
    parser.add_argument("--ready-timeout", type=float, default=30.0,
                        help="seconds to wait for the server to answer")
    parser.add_argument("--output-json", default=None, help="write figures and per-request data")
    parser.add_argument("--plot", default=None, metavar="FILE.png",
                        help="draw a timeline of the run (matplotlib)")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def load_tokenizer_for(args: argparse.Namespace):
    from pagedserve.model_loader.files import resolve_model_path
    from pagedserve.tokenizer import load_tokenizer

    name = args.tokenizer or args.model
    try:
        path = resolve_model_path(name)
    except (ValueError, FileNotFoundError):
        if args.tokenizer:
            raise
        path = resolve_model_path(None)  # --model is only an API alias
    return load_tokenizer(path)


def main(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no log line per request
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1; got {args.max_concurrency}")
    tokenizer = None
    if args.dataset_name == "random" or datasets.needs_tokenizer(args.dataset_name):
        tokenizer = load_tokenizer_for(args)
    samples = datasets.get_samples(args, tokenizer, max_model_len=args.max_model_len)
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    results, duration, model = asyncio.run(benchmark(args, samples, base_url, args.model))
    metrics = compute_metrics(results, duration)
    print_report(metrics)
    errors = [r.error for r in results if not r.success]
    if errors:
        print(f"first error: {errors[0]}")
    if args.plot:
        rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
        plot(results, args.plot, f"{model} @ {base_url}: {len(samples)} requests, "
                                 f"rate {rate}/s, max concurrency {args.max_concurrency}")
        print(f"plot written to {args.plot}")
    if args.output_json:
        keep = {k: (str(v) if isinstance(v, float) and math.isinf(v) else v)
                for k, v in vars(args).items() if k != "bench_main"}
        with open(args.output_json, "w") as f:
            json.dump({"args": keep, "model": model, "dataset": datasets.summary(samples),
                       "metrics": metrics, "requests": [asdict(r) for r in results]}, f)
    return 0 if metrics["completed"] else 1
