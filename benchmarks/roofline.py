"""One request alone against the memory roofline: a decode step reads every weight once,
so a lone request can decode at most (read bandwidth) / (weight bytes per token) tokens/s.

    PYTHONPATH=. python benchmarks/roofline.py [MODEL] [--dtype D] [--quantization Q]
        [--rounds N]

Prints the bytes of weights one decode token reads (each Linear as its quantization method
holds it: the packed copy of a float weight, GGUF blocks, int8 rows and scales), then per
round: the machine's read bandwidth (a torch sum over 2 GiB written first, since untouched
pages all map one zero page; best of 3, taken before and after the round's decode and
averaged), the roofline it gives, and one request's decode rate (32 prompt tokens, 128
greedy tokens, ignore_eos: 128 / (t(129 tokens) - t(1 token))). Last, the medians over the
rounds and the prefill rate (512 prompt tokens, 1 output token, median of 3). The
bandwidth is measured beside each decode, not once: a shared host's read bandwidth moves
between 48 and 78 GB/s from one minute to the next (benchmarks/README.md, 2026-12-07).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedserve import LLM, SamplingParams
from pagedserve.quantization.base import KIND_FLOAT, Linear


def read_bandwidth(x: torch.Tensor) -> float:
    """Bytes/s of ``torch.sum`` over ``x`` (written first), best of 3."""
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.nbytes / best


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights a decode token reads: what each Linear's kernel multiplies by."""
    total = 0
    for layer in model.modules():
        if isinstance(layer, Linear):
            a, b, kind = layer.method.fused_kernel(layer)
            total += b.nbytes if kind == KIND_FLOAT and b.numel() else a.nbytes + b.nbytes
    return total


def seconds(llm: LLM, prompt_len: int, max_tokens: int) -> float:
    """Wall time of one request (ids 100.. as its prompt)."""
    prompt = {"prompt_token_ids": [100 + i for i in range(prompt_len)]}
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    llm = LLM(model=args.model, dtype=args.dtype, quantization=args.quantization,
              enable_prefix_caching=False)
    per_token = weight_bytes(llm.engine.executor.driver_worker.model)
    print(f"weights read per token {per_token / 1e9:.3f} GB")
    x = torch.ones(2 * 2**28)  # 2 GiB of float32
    seconds(llm, 32, 129)  # warm-up
    decodes, fractions = [], []
    for round_ in range(args.rounds):
        before = read_bandwidth(x)
        decode = 128 / (seconds(llm, 32, 129) - seconds(llm, 32, 1))
        bandwidth = (before + read_bandwidth(x)) / 2
        roofline = bandwidth / per_token
        decodes.append(decode)
        fractions.append(decode / roofline)
        print(f"round {round_ + 1}: read bandwidth {bandwidth / 1e9:.1f} GB/s, roofline "
              f"{roofline:.1f} tok/s, decode {decode:.1f} tok/s = {decode / roofline:.0%}",
              flush=True)
    seconds(llm, 512, 1)  # warm-up
    prefill = 512 / statistics.median(seconds(llm, 512, 1) for _ in range(3))
    print(f"lone request: prefill {prefill:.1f} tok/s (512 tokens), decode "
          f"{statistics.median(decodes):.1f} tok/s = {statistics.median(fractions):.0%} of the "
          f"roofline (medians of {args.rounds} rounds)")


if __name__ == "__main__":
    main()
