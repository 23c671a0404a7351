"""Per-shape rate of the int8 W8A8 linear (``pagedserve/quantization/int8.py``) vs float32
``F.linear`` on SmolLM2-135M's shapes, at M = 1, 16, 64, 256 rows (tokens).

    PYTHONPATH=. python benchmarks/int8_gemm.py [--threads N]

Columns, in G(FL)OP/s of ``2 * M * K * N``: ``f32`` = ``F.linear`` on a float32 weight;
``int8`` = ``int8_linear`` (per-row activation quantization + ``torch._int_mm`` + scales);
``packed`` = ``int8_linear`` on the packed weight (our product: ``vpdpbusd`` with
AVX512-VNNI, ``vpmaddubsw`` and ``vpmaddwd`` with AVX2 alone, else ``-``); ``amx`` = on the
AMX-packed weight (``TDPBUSD`` tiles, CPUs with AMX, else ``-``); ``int_mm`` =
``torch._int_mm`` alone on the int8 weight ``[N, K]`` passed transposed, as ``int8_linear``
does; ``int_mm KN`` = on a contiguous ``[K, N]`` copy. Best of 5 timings.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedserve.cpu_ops import cpu_ops_available, load_cpu_ops
from pagedserve.quantization.int8 import Int8Weight, int8_linear, quantize_rows, quantize_weight

# (name, K, N): fused q/k/v (9 + 2 * 3 heads of 64), o, fused gate/up, down, tied LM head
SHAPES = [("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576),
          ("lm_head", 576, 49152)]
ROWS = (1, 16, 64, 256)


def best_time(fn: Callable[[], object], repeats: int = 5, min_s: float = 0.05) -> float:
    """Seconds per call: the best of ``repeats`` loops of at least ``min_s`` each."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        calls, start = 0, time.perf_counter()
        while time.perf_counter() - start < min_s:
            fn()
            calls += 1
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"threads {torch.get_num_threads()}; G(FL)OP/s")
    print(f"{'shape':8s} {'K':>5s} {'N':>6s} {'M':>4s} {'f32':>7s} {'int8':>7s} {'packed':>7s} "
          f"{'amx':>7s} {'int_mm':>7s} {'int_mm KN':>9s} {'int8/f32':>8s}")
    ops = load_cpu_ops() if cpu_ops_available() else None
    with torch.inference_mode():
        for name, k, n in SHAPES:
            w = torch.randn(n, k, generator=gen)
            q = quantize_weight(w)
            rows = Int8Weight(q.qweight, q.scale)
            packed = tiles = None
            if ops is not None and ops.packed_int8_available():
                packed = Int8Weight(q.qweight, q.scale, ops.pack_int8_weight(q.qweight))
            if ops is not None and ops.amx_tiles_available() and k % 64 == 0:
                tiles = Int8Weight(q.qweight, q.scale, ops.pack_int8_weight_amx(q.qweight))
            kn = q.qweight.t().contiguous()
            for m in ROWS:
                x = torch.randn(m, k, generator=gen)
                xq, _ = quantize_rows(x)
                calls = [(F.linear, x, w), (int8_linear, x, rows), (int8_linear, x, packed),
                         (int8_linear, x, tiles), (torch._int_mm, xq, q.qweight.t()),
                         (torch._int_mm, xq, kn)]
                times = [best_time(lambda c=c: c[0](c[1], c[2])) if c[2] is not None else None
                         for c in calls]
                rates = [f"{2 * m * k * n / t / 1e9:{width}.1f}" if t else f"{'-':>{width}s}"
                         for t, width in zip(times, (7, 7, 7, 7, 7, 9))]
                print(f"{name:8s} {k:5d} {n:6d} {m:4d} " + " ".join(rates)
                      + f" {times[0] / times[1]:8.2f}", flush=True)


if __name__ == "__main__":
    main()
