"""``pagedserve bench throughput``: offline throughput, all requests queued at once.

Every request of the dataset (see ``datasets.py``) is added to one engine before the first
step; decoding is greedy with ``ignore_eos``, so each request generates exactly its
expected output length. Prints requests/s, total (prompt + output) tokens/s, output
tokens/s and the elapsed time, plus the engine steps and mean sequences per step.
``--scheduling static`` runs the same requests with static batching (same model code and
kernels) for a side-by-side comparison with continuous batching. ``--timeline FILE.html``
(or ``.png``) writes the run's step timeline and KV block usage, as ``/dashboard`` draws them.
``--structured-outputs json`` runs the requests twice on one engine, unconstrained and then
constrained to a JSON schema (same output lengths: ``ignore_eos``), and prints the ratio
and the grammar's compile time, first and cached. ``--lora-path DIR ...`` (vLLM's flag;
with ``--enable-lora``) gives request i the adapter ``i mod len(paths)``.

Example::

    pagedserve bench throughput --dataset-name workload --dtype float32
    pagedserve bench throughput --dataset-name workload --scheduling static --max-num-seqs 16
    pagedserve bench throughput --dataset-name workload --structured-outputs json
"""

from __future__ import annotations

import argparse
import json
import time
from typing import TYPE_CHECKING

from tqdm import tqdm

from pagedserve.args import EngineArgs
from pagedserve.benchmarks import datasets
from pagedserve.benchmarks.spec_stats import print_spec_decode_report, spec_decode_report
from pagedserve.lora.request import LoRARequest
from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams

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
    parser.add_argument("--structured-outputs", choices=["json"], default=None,
                        help="also run every request constrained to a JSON schema, and "
                             "compare")
    parser.add_argument("--lora-path", nargs="+", default=None, metavar="DIR",
                        help="PEFT LoRA adapter directories (needs --enable-lora): request i "
                             "runs with adapter i mod their number")
    EngineArgs.add_cli_args(parser)


def lora_requests(paths: list[str] | None, num: int) -> list[LoRARequest | None]:
    """Request i's adapter: ``paths[i % len(paths)]`` (named ``lora-<j>``, id j + 1), or
    None for every request without ``paths``."""
    if not paths:
        return [None] * num
    return [LoRARequest(f"lora-{i % len(paths)}", i % len(paths) + 1, paths[i % len(paths)])
            for i in range(num)]


# An object whose string can go on as long as the output: no request ends its grammar early.
BENCH_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}},
                "required": ["answer"]}


def run(engine: LLMEngine, samples: list[datasets.SampleRequest], detokenize: bool = True,
        use_tqdm: bool = True, structured: StructuredOutputsParams | None = None,
        loras: list[LoRARequest | None] | None = None) -> dict:
    """Queue every request (request i with adapter ``loras[i]`` if given), step the
    engine until all finish; return the figures.

    The prefix cache is emptied first, so that a second run on the same engine computes
    the same prompts again. ``decode_step_time`` is the mean time of the steps that only
    decode (one token per running sequence): the part a per-token cost such as a grammar
    bitmask adds to."""
    engine.kv_cache_manager.pool.reset_prefix_cache()
    spec_start = engine.spec_decoding_stats()
    start = time.perf_counter()
    for i, s in enumerate(samples):
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=s.expected_output_len,
                                detokenize=detokenize, structured_outputs=structured)
        engine.add_request(f"{'so-' if structured else ''}{i}",
                           {"prompt_token_ids": s.prompt_token_ids}, params,
                           lora_request=loras[i] if loras else None)
    steps = sampled = 0
    output_tokens = 0
    decode_times: list[float] = []
    # Progress in output tokens: requests all finish near the end, tokens come every step.
    expected = sum(s.expected_output_len for s in samples)
    with tqdm(total=expected, desc="Output tokens", unit="tok", disable=not use_tqdm) as bar:
        while engine.has_unfinished_requests():
            pure_decode = not engine.scheduler.waiting and all(
                r.num_computed_tokens == r.num_tokens - 1 for r in engine.scheduler.running)
            t0 = time.perf_counter()
            outputs = engine.step()
            if pure_decode:
                decode_times.append(time.perf_counter() - t0)
            steps += 1
            sampled += len(outputs)  # the requests that produced a token: one each
            bar.update(len(outputs))
            for out in outputs:
                if out.finished:
                    output_tokens += sum(len(c.token_ids) for c in out.outputs)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(s.prompt_len for s in samples)
    return {
        "scheduling": engine.scheduler_config.scheduling,
        "num_requests": len(samples),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "expected_output_tokens": expected,
        "elapsed_time": elapsed,
        "requests_per_second": len(samples) / elapsed,
        "tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
        "num_steps": steps,
        "mean_requests_sampled_per_step": sampled / steps if steps else 0.0,
        "num_preemptions": engine.scheduler.num_preemptions,
        "decode_step_time": sum(decode_times) / len(decode_times) if decode_times else None,
        "num_decode_steps": len(decode_times),
        "spec_decoding": spec_decode_report(spec_start, engine.spec_decoding_stats()),
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
        ("decode-only step (ms)", "n/a" if r["decode_step_time"] is None else
         f"{r['decode_step_time'] * 1e3:.1f} (mean of {r['num_decode_steps']})"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print_spec_decode_report(r.get("spec_decoding"))


def compile_times(engine: LLMEngine, spec: StructuredOutputsParams) -> dict:
    """Seconds to compile ``spec``'s grammar the first time (with the vocabulary's
    preprocessing, done once per engine) and again (a cache hit)."""
    from pagedserve.structured_output.grammar import GrammarCache

    cache = GrammarCache(engine.tokenizer, engine.hf_config.vocab_size,
                         engine.structured_output.stop_token_ids)
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        cache.get(spec).result()
        times.append(time.perf_counter() - t0)
    cache.shutdown()
    return {"compile_first_s": times[0], "compile_cached_s": times[1]}


def _best(runs: list[dict]) -> dict:
    """The run with the highest output tokens/s (the least disturbed on a shared machine)."""
    return max(runs, key=lambda r: r["output_tokens_per_second"])


def _structured(engine: LLMEngine, samples, args: argparse.Namespace, free: dict) -> dict:
    """Alternate unconstrained and constrained runs (two more of each after ``free``) and
    compare the best of each: on a shared machine, load shifts between runs."""
    spec = StructuredOutputsParams(json=BENCH_SCHEMA)
    times = compile_times(engine, spec)
    detok, bar = not args.disable_detokenize, not args.disable_tqdm
    frees, constrained = [free], []
    for _ in range(2):
        constrained.append(run(engine, samples, detok, bar, spec))
        frees.append(run(engine, samples, detok, bar))
    best_free, result = _best(frees), _best(constrained)
    print("\nconstrained to a JSON schema (best of 2; unconstrained: best of 3):")
    print_report(result)
    ratio = result["output_tokens_per_second"] / best_free["output_tokens_per_second"]
    step_ratio = min(r["decode_step_time"] for r in frees) / min(
        r["decode_step_time"] for r in constrained)
    print(f"constrained / unconstrained: output tokens/s {ratio:.3f}, decode steps/s "
          f"{step_ratio:.3f}; grammar compile: {times['compile_first_s'] * 1e3:.1f} ms first "
          f"(with the vocabulary's preprocessing), {times['compile_cached_s'] * 1e3:.3f} ms "
          "cached")
    return {**result, **times, "ratio_to_unconstrained": ratio, "decode_step_ratio": step_ratio,
            "unconstrained_runs": frees, "constrained_runs": constrained}


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
    result = run(engine, samples, not args.disable_detokenize, not args.disable_tqdm,
                 loras=lora_requests(args.lora_path, len(samples)))
    print_report(result)
    if args.timeline:  # the main run's steps only
        write_timeline(args.timeline, engine.timeline.columns(), engine.num_blocks,
                       f"pagedserve bench throughput: {len(samples)} requests, "
                       f"{engine.scheduler_config.scheduling} batching, "
                       f"{result['output_tokens_per_second']:.1f} output tok/s")
        print(f"timeline written to {args.timeline}")
    if args.structured_outputs:
        result["structured_outputs"] = _structured(engine, samples, args, dict(result))
    if result["output_tokens"] != result["expected_output_tokens"]:
        print(f"warning: {result['output_tokens']} output tokens generated, "
              f"{result['expected_output_tokens']} expected")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "bench_main"},
                       "dataset": datasets.summary(samples), "result": result}, f, indent=2)
    return 0
