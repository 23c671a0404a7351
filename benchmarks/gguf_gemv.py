"""The GGUF block kernel (``torch.ops.pagedserve.ggml_mul_mat_a8``), at one row by default
as a lone request's decode step uses it: every block weight of the bundled model as the
engine holds it (fused q/k/v and gate/up, the tied LM head), one after the other as in a
forward pass, read from DRAM (96 MB, twice the L3 here). Prints ms per step (``--rows`` tokens: 1
for a lone decode, 2,048 for a prefill's GEMMs) and the rate the weights stream at.

    PYTHONPATH=. python benchmarks/gguf_gemv.py [--threads N] [--rows M]

A benchmark, not a test: it prints figures (``benchmarks/README.md`` records them).
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedserve import LLM
from pagedserve.quantization.base import Linear


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rows", type=int, default=1, help="rows of x (tokens in the step)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    llm = LLM(dtype="float32", max_model_len=256, kv_cache_memory_bytes=16 << 20)
    model = llm.engine.executor.driver_worker.model
    torch.set_num_threads(args.threads)
    # in forward order: 30 x (qkv, o, gate_up, down), then the (tied) head
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    gen = torch.Generator().manual_seed(0)
    steps = [(m.method.qweight, int(m.method.qtype),
              torch.randn(args.rows, m.in_features, generator=gen)) for m in layers]
    total = sum(qweight.numel() for qweight, _, _ in steps)
    mul_mat = torch.ops.pagedserve.ggml_mul_mat_a8

    def step() -> None:
        for qweight, qtype, x in steps:
            mul_mat(qweight, x, qtype)

    for _ in range(3):
        step()
    start = time.perf_counter()
    for _ in range(args.repeats):
        step()
    seconds = (time.perf_counter() - start) / args.repeats
    print(f"{len(steps)} weights, {total / 1e6:.1f} MB of blocks, {args.rows} row(s), "
          f"{args.threads} thread(s): {seconds * 1e3:.2f} ms per step, "
          f"{total / seconds / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
