"""One request alone against the memory roofline: a decode step reads every weight once,
so a lone request can decode at most (read bandwidth) / (weight bytes per token) tokens/s.

    PYTHONPATH=. python benchmarks/roofline.py [MODEL] [--dtype D] [--quantization Q]

Prints the machine's read bandwidth (a torch sum over 2 GiB written first: untouched pages
all map one zero page; best of 5), the bytes of weights one decode token reads (each
Linear as its quantization method holds it: the packed copy of a float weight, GGUF
blocks, int8 rows and scales), the roofline they give, and the measured rates of one
request of 32 prompt tokens: prefill (512 prompt tokens, 1 output token) and decode
(128 greedy tokens, ignore_eos; (t(129 tokens) - t(1 token)) / 128, medians of 3).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedserve import LLM, SamplingParams
from pagedserve.quantization.base import KIND_FLOAT, Linear


def read_bandwidth(gib: int = 2) -> float:
    """Bytes/s of ``torch.sum`` over ``gib`` GiB of float32 written first, best of 5."""
    x = torch.ones(gib * 2**28)
    best = float("inf")
    for _ in range(5):
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
    """Median of 3 wall times of one request (ids 100.. as its prompt)."""
    prompt = {"prompt_token_ids": [100 + i for i in range(prompt_len)]}
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default=None)
    args = parser.parse_args()
    bandwidth = read_bandwidth()
    llm = LLM(model=args.model, dtype=args.dtype, quantization=args.quantization,
              enable_prefix_caching=False)
    per_token = weight_bytes(llm.engine.executor.driver_worker.model)
    roofline = bandwidth / per_token
    prefill = 512 / seconds(llm, 512, 1)
    decode = 128 / (seconds(llm, 32, 129) - seconds(llm, 32, 1))
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s; weights read per token "
          f"{per_token / 1e9:.3f} GB; roofline {roofline:.1f} tok/s")
    print(f"lone request: prefill {prefill:.1f} tok/s (512 tokens), decode {decode:.1f} tok/s "
          f"= {decode / roofline:.0%} of the roofline")


if __name__ == "__main__":
    main()
