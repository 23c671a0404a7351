"""``pagedserve bench latency``: end-to-end latency of one fixed batch, repeated.

Each iteration adds ``--batch-size`` requests of ``--input-len`` random prompt tokens
(fresh ones each iteration, so no prefix-cache hits) generating exactly ``--output-len``
tokens (greedy, ``ignore_eos``), and steps the engine until all finish. After
``--num-iters-warmup`` untimed iterations, ``--num-iters`` timed ones give the mean and
the p10/p25/p50/p75/p90/p99 latency.

It also prints the achieved FLOP rate beside this machine's GEMM rate, measured in the
same process: the model's matmul FLOPs per iteration (2 x weight elements per token
through the linear layers, 2 x hidden x vocab per sampled row for the LM head, and
4 x heads x head_dim x context per token and layer for causal attention, windows
ignored) over the median latency, against one large ``torch.mm`` (2048^3) in the
engine's dtype.

Example::

    pagedserve bench latency --batch-size 64 --input-len 32 --output-len 128
"""

from __future__ import annotations

import argparse
import json
import time
from typing import TYPE_CHECKING

import numpy as np
from tqdm import tqdm

from pagedserve.args import EngineArgs
from pagedserve.benchmarks.datasets import random_samples
from pagedserve.benchmarks.spec_stats import print_spec_decode_report, spec_decode_report
from pagedserve.sampling_params import SamplingParams

if TYPE_CHECKING:  # the engine (torch, models) loads only when a benchmark runs
    import torch

    from pagedserve.engine.llm_engine import LLMEngine

PERCENTILES = (10, 25, 50, 75, 90, 99)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None, help="model (default: bundled)")
    parser.add_argument("--batch-size", type=int, default=8, help="requests per iteration")
    parser.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    parser.add_argument("--num-iters-warmup", type=int, default=3, help="untimed iterations")
    parser.add_argument("--num-iters", type=int, default=10, help="timed iterations")
    parser.add_argument("--output-json", default=None, help="write the figures here")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    EngineArgs.add_cli_args(parser)


def run_once(engine: LLMEngine, prompts: list[list[int]], output_len: int, tag: str) -> float:
    """Seconds from adding the batch to its last request finishing."""
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=output_len)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def summarize(latencies: list[float]) -> dict:
    arr = np.asarray(latencies)
    return {"avg_latency": float(arr.mean()), "latencies": [float(x) for x in arr],
            "percentiles": {str(p): float(np.percentile(arr, p)) for p in PERCENTILES}}


def iteration_flops(engine: LLMEngine, batch_size: int, input_len: int, output_len: int) -> float:
    """Matmul FLOPs of one iteration (see the module docstring)."""
    import torch

    model, config = engine.executor.driver_worker.model, engine.hf_config
    linear = sum(m.in_features * m.out_features for m in model.layers.modules()
                 if isinstance(m, torch.nn.Linear))
    tokens = input_len + output_len - 1  # forward passes per request (the last token is not fed back)
    heads, head_dim = config.num_attention_heads, model.layers[0].self_attn.head_dim
    contexts = tokens * (tokens + 1) / 2  # causal: token t attends to t + 1 keys
    attention = 4 * heads * head_dim * config.num_hidden_layers * contexts
    lm_head = 2 * config.hidden_size * config.vocab_size * output_len
    return batch_size * (2 * linear * tokens + attention + lm_head)


def gemm_rate(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of an ``n``-cubed ``torch.mm`` in ``dtype`` on the CPU (median of ``repeats``)."""
    import torch

    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - start)
    return 2 * n**3 / float(np.median(times))


def print_report(r: dict) -> None:
    print(f"Avg latency: {r['avg_latency']:.4f} seconds")
    for p, v in r["percentiles"].items():
        print(f"{p}% percentile latency: {v:.4f} seconds")
    print(f"Output tokens/s: {r['output_tokens_per_second']:.1f} (at the median latency)")
    print_spec_decode_report(r.get("spec_decoding"))
    print(f"Achieved: {r['achieved_gflops']:.1f} GFLOP/s of model matmuls")
    if "gemm_gflops" in r:
        print(f"GEMM rate (torch.mm 2048^3, {r['dtype']}): {r['gemm_gflops']:.1f} GFLOP/s; "
              f"achieved = {100 * r['achieved_gflops'] / r['gemm_gflops']:.0f}% of it")


def main(args: argparse.Namespace) -> int:
    for name in ("batch_size", "input_len", "output_len", "num_iters"):
        if getattr(args, name) < 1:
            raise ValueError(f"{name} must be >= 1; got {getattr(args, name)}")
    if args.num_iters_warmup < 0:
        raise ValueError(f"num_iters_warmup must be >= 0; got {args.num_iters_warmup}")
    from pagedserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineArgs.from_cli_args(args))
    if args.input_len + args.output_len > engine.max_model_len:
        raise ValueError(f"input_len + output_len ({args.input_len + args.output_len}) exceeds "
                         f"max_model_len ({engine.max_model_len})")
    special = set(getattr(engine.tokenizer, "all_special_ids", ()) or ())
    total = args.num_iters_warmup + args.num_iters
    batches = [[s.prompt_token_ids for s in random_samples(
        args.batch_size, args.input_len, args.output_len, 0.0, engine.hf_config.vocab_size,
        args.seed + it, special)] for it in range(total)]
    latencies = []
    spec_start = engine.spec_decoding_stats()
    for it in tqdm(range(total), desc="Iterations", disable=args.disable_tqdm):
        if it == args.num_iters_warmup:
            spec_start = engine.spec_decoding_stats()
        seconds = run_once(engine, batches[it], args.output_len, f"it{it}")
        if it >= args.num_iters_warmup:
            latencies.append(seconds)
    result = summarize(latencies)
    result["output_tokens_per_second"] = (args.batch_size * args.output_len
                                          / result["percentiles"]["50"])
    result["spec_decoding"] = spec_decode_report(spec_start, engine.spec_decoding_stats())
    flops = iteration_flops(engine, args.batch_size, args.input_len, args.output_len)
    result["achieved_gflops"] = flops / result["percentiles"]["50"] / 1e9
    if engine.device == "cpu":
        result["dtype"] = str(engine.dtype).removeprefix("torch.")
        result["gemm_gflops"] = gemm_rate(engine.dtype) / 1e9
    print_report(result)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "bench_main"},
                       **result}, f, indent=2)
    return 0
