"""``pagedserve bench throughput``: offline throughput, all requests queued at once.

Every request of the dataset (see ``datasets.py``) is added to one engine before the first
step; decoding is greedy with ``ignore_eos``, so each request generates exactly its
expected output length. Prints requests/s, total (prompt + output) tokens/s, output
tokens/s and the elapsed time, plus the engine steps and mean sequences per step.
``--scheduling static`` runs the same requests with static batching (same model code and
kernels) for a side-by-side comparison with continuous batching. ``--timeline FILE.html``
(or ``.png``) writes the run's step timeline and KV block usage, as ``/dashboard`` draws them.

Example::

    pagedserve bench throughput --dataset-name workload --dtype float32
    pagedserve bench throughput --dataset-name workload --scheduling static --max-num-seqs 16
"""

from __future__ import annotations

import argparse
import json
import time
from typing import TYPE_CHECKING

from tqdm import tqdm

from pagedserve.benchmarks import datasets
from pagedserve.engine.args import EngineArgs
from pagedserve.sampling_params import SamplingParams

if TYPE_CHECKING:  # the engine (torch, models) loads only when a benchmark runs
    from pagedserve.engine.llm_engine import LLMEngine


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None, help="model (default: bundled)")
    datasets.add_dataset_args(parser)
    parser.add_argument("--output-json", default=None, help="write the figures here")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    parser.add_argument("--timeline", default=None, metavar="FILE.html|FILE.png",
                        help="write every step's tokens (prefill/decode), time, rows, "
                             "preemptions and KV blocks used (.png needs matplotlib)")
    parser.add_argument("--disable-detokenize", action="store_true",
                        help="do not build output text (token ids only)")
    EngineArgs.add_cli_args(parser)


def run(engine: LLMEngine, samples: list[datasets.SampleRequest], detokenize: bool = True,
        use_tqdm: bool = True) -> dict:
    """Queue every request, step the engine until all finish; return the figures."""
    start = time.perf_counter()
    for i, s in enumerate(samples):
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=s.expected_output_len,
                                detokenize=detokenize)
        engine.add_request(str(i), {"prompt_token_ids": s.prompt_token_ids}, params)
    steps = sampled = 0
    output_tokens = 0
    with tqdm(total=len(samples), desc="Processed prompts", disable=not use_tqdm) as bar:
        while engine.has_unfinished_requests():
            outputs = engine.step()
            steps += 1
            sampled += len(outputs)  # the requests that produced a token
            for out in outputs:
                if out.finished:
                    output_tokens += sum(len(c.token_ids) for c in out.outputs)
                    bar.update(1)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(s.prompt_len for s in samples)
    return {
        "scheduling": engine.scheduler_config.scheduling,
        "num_requests": len(samples),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "expected_output_tokens": sum(s.expected_output_len for s in samples),
        "elapsed_time": elapsed,
        "requests_per_second": len(samples) / elapsed,
        "tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
        "num_steps": steps,
        "mean_requests_sampled_per_step": sampled / steps if steps else 0.0,
        "num_preemptions": engine.scheduler.num_preemptions,
    }


def print_report(r: dict) -> None:
    print(f"Throughput: {r['requests_per_second']:.2f} requests/s, "
          f"{r['tokens_per_second']:.2f} total tokens/s, "
          f"{r['output_tokens_per_second']:.2f} output tokens/s")
    rows = [
        ("scheduling", r["scheduling"]),
        ("requests", r["num_requests"]),
        ("prompt tokens", r["prompt_tokens"]),
        ("output tokens", r["output_tokens"]),
        ("elapsed (s)", f"{r['elapsed_time']:.2f}"),
        ("engine steps", r["num_steps"]),
        ("requests sampled per step", f"{r['mean_requests_sampled_per_step']:.1f} (mean)"),
        ("preemptions", r["num_preemptions"]),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def main(args: argparse.Namespace) -> int:
    from pagedserve.benchmarks.timeline_plot import check_path, write_timeline
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.engine.timeline import StepTimeline

    if args.timeline:
        check_path(args.timeline)
    engine = LLMEngine(EngineArgs.from_cli_args(args))
    engine.timeline = StepTimeline(maxlen=None)  # every step, for --timeline
    samples = datasets.get_samples(args, engine.tokenizer, engine.hf_config.vocab_size,
                                   engine.max_model_len)
    result = run(engine, samples, not args.disable_detokenize, not args.disable_tqdm)
    print_report(result)
    if args.timeline:
        write_timeline(args.timeline, engine.timeline.columns(), engine.num_blocks,
                       f"pagedserve bench throughput: {len(samples)} requests, "
                       f"{engine.scheduler_config.scheduling} batching, "
                       f"{result['output_tokens_per_second']:.1f} output tok/s")
        print(f"timeline written to {args.timeline}")
    if result["output_tokens"] != result["expected_output_tokens"]:
        print(f"warning: {result['output_tokens']} output tokens generated, "
              f"{result['expected_output_tokens']} expected")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "bench_main"},
                       "dataset": datasets.summary(samples), "result": result}, f, indent=2)
    return 0
