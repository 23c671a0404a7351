#!/usr/bin/env python3
"""The "traditional framework" baseline: the same requests through Hugging Face
transformers ``generate``, in static batches.

Requests (the dataset flags of ``pagedserve bench throughput``; default: the shared
64-request workload) go in order in batches of ``--batch-size``. Each batch is left-padded
and run with one greedy ``generate`` call with ``min_new_tokens = max_new_tokens`` = the
largest output length in the batch: EOS is masked and no row can stop early, as in static
batching. Output tokens counted are the requested ones (each row's own length); the
padding rows compute beyond that are reported as computed tokens. Prints the same figures
as ``pagedserve bench throughput``.

Usage (from the repository root)::

    python benchmarks/hf_baseline.py --dataset-name workload --dtype float32 --batch-size 16
    python benchmarks/hf_baseline.py --model path/to/hf_dir --dataset-name random --num-prompts 32

The model is the bundled SmolLM2 GGUF (loaded by transformers with ``gguf_file``, which
needs ``accelerate``) or any Hugging Face model directory.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from tqdm import tqdm

from pagedserve.benchmarks import datasets
from pagedserve.model_loader.files import resolve_model_path
from pagedserve.tokenizer import load_tokenizer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="Hugging Face model directory or .gguf file (default: bundled)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batch-size", type=int, default=16, help="requests per static batch")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the dataset sampling")
    parser.add_argument("--output-json", default=None, help="write the figures here")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    datasets.add_dataset_args(parser)
    parser.set_defaults(dataset_name="workload")
    return parser.parse_args(argv)


def load_model(path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    if path.is_file():  # GGUF: transformers dequantizes it (needs accelerate)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                     dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.eval()


def pad_id(model, tokenizer) -> int:
    for value in (model.config.pad_token_id, getattr(tokenizer, "pad_token_id", None),
                  model.config.eos_token_id):
        if isinstance(value, list):
            value = value[0]
        if value is not None:
            return value
    return 0


def run_batch(model, prompts: list[list[int]], max_new: int, pad: int) -> torch.Tensor:
    """Greedy ``generate`` on left-padded prompts; every row gets exactly ``max_new``
    tokens. Returns the new tokens, shape (batch, max_new)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                             max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=pad,
                             top_p=None, top_k=None, temperature=None)
    new = out[:, width:]
    if new.shape[1] != max_new:
        raise RuntimeError(f"generate returned {new.shape[1]} new tokens, expected {max_new}")
    return new


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(path)
    t_load = time.perf_counter()
    model = load_model(path, getattr(torch, args.dtype))
    t_load = time.perf_counter() - t_load
    samples = datasets.get_samples(args, tokenizer, model.config.vocab_size,
                                   model.config.max_position_embeddings)
    pad = pad_id(model, tokenizer)
    run_batch(model, [samples[0].prompt_token_ids[:16]], 2, pad)  # untimed warm-up

    output_tokens = computed_tokens = 0
    batches = [samples[i:i + args.batch_size] for i in range(0, len(samples), args.batch_size)]
    start = time.perf_counter()
    for batch in tqdm(batches, desc="Batches", disable=args.disable_tqdm):
        max_new = max(s.expected_output_len for s in batch)
        run_batch(model, [s.prompt_token_ids for s in batch], max_new, pad)
        output_tokens += sum(s.expected_output_len for s in batch)
        computed_tokens += len(batch) * max_new
    elapsed = time.perf_counter() - start

    prompt_tokens = sum(s.prompt_len for s in samples)
    result = {
        "engine": "transformers-generate-static",
        "dtype": args.dtype,
        "batch_size": args.batch_size,
        "threads": torch.get_num_threads(),
        "load_time": t_load,
        "num_requests": len(samples),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "computed_output_tokens": computed_tokens,
        "elapsed_time": elapsed,
        "requests_per_second": len(samples) / elapsed,
        "tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
    }
    print(f"Throughput: {result['requests_per_second']:.2f} requests/s, "
          f"{result['tokens_per_second']:.2f} total tokens/s, "
          f"{result['output_tokens_per_second']:.2f} output tokens/s")
    rows = [("engine", f"transformers generate, static batches of {args.batch_size}"),
            ("dtype", args.dtype), ("requests", len(samples)), ("prompt tokens", prompt_tokens),
            ("output tokens", output_tokens),
            ("computed output tokens", f"{computed_tokens} (rows run to their batch's longest)"),
            ("elapsed (s)", f"{elapsed:.2f}"), ("load (s)", f"{t_load:.2f}")]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "dataset": datasets.summary(samples),
                       "result": result}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
