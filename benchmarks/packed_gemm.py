"""Our batch-invariant float GEMMs beside the libraries' on a model's shapes, float32 or
bfloat16: how close to the machine's peak they run, and which routes give a row the same
bits alone as in a batch.

    PYTHONPATH=. python benchmarks/packed_gemm.py [--dtype float32|bfloat16]
        [--shapes smollm2|llama-1b] [--threads N]

Routes (columns, in GFLOP/s of ``2 * M * K * N``, best of 5 timings):

- ``linear``: ``F.linear`` (MKL for float32, oneDNN for bfloat16);
- ``mkl``: ``torch.ops.mkl._mkl_linear`` on an MKL-packed weight (what inductor's
  ``freezing`` emits; float32 only; packed for 64 rows, so other row counts fall back);
- ``onednn``: ``torch.ops.mkldnn._linear_pointwise`` on a oneDNN-reordered weight;
- ``fma``: ``fixed_order_linear`` on ``pack_linear_weight`` (float32 FMA chains);
- ``pairs``: ``fixed_order_linear`` on ``pack_linear_weight_pairs`` (bfloat16 only, CPUs
  with AVX512-BF16: one ``vdpbf16ps`` chain over k-pairs);
- ``amx``: ``fixed_order_linear`` on ``pack_linear_weight_amx`` (bfloat16 only, CPUs with
  AMX: ``TDPBF16PS`` tiles over k-steps of 16 pairs).

``peak`` is the best library rate over all shapes and row counts of the run, the
same-dtype peak the figures are measured against. ``invariant``: whether each route's
row 0 equals its 1-row product (ours are invariant by construction; a library's "y" here
is one sample, not a promise).
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from int8_gemm import ROWS, best_time

from pagedserve.cpu_ops import load_cpu_ops

# (name, K, N) of Llama 3.2 1B's shapes with SmolLM2's vocabulary (../shared/peers/README.md)
LLAMA_1B_SHAPES = [("qkv", 2048, 3072), ("o", 2048, 2048), ("gate_up", 2048, 16384),
                   ("down", 8192, 2048), ("lm_head", 2048, 49152)]
LIBRARIES = ("linear", "mkl", "onednn")


def routes(x: torch.Tensor, w: torch.Tensor) -> dict[str, functools.partial]:
    """Each route's product ``x @ w.T`` as a call (weights packed here, once)."""
    ops, n = load_cpu_ops(), w.shape[0]
    out = {"linear": functools.partial(F.linear, x, w)}
    if w.dtype == torch.float32:
        out["mkl"] = functools.partial(torch.ops.mkl._mkl_linear, x,
                                       torch.ops.mkl._mkl_reorder_linear_weight(w, 64), w,
                                       None, x.shape[0])
    out["onednn"] = functools.partial(torch.ops.mkldnn._linear_pointwise, x,
                                      torch.ops.mkldnn._reorder_linear_weight(w, 64), None,
                                      "none", [], "")
    out["fma"] = functools.partial(ops.fixed_order_linear, x, ops.pack_linear_weight(w), n)
    if w.dtype == torch.bfloat16 and ops.pair_linear_available():
        out["pairs"] = functools.partial(ops.fixed_order_linear, x,
                                         ops.pack_linear_weight_pairs(w), n)
    if w.dtype == torch.bfloat16 and ops.amx_tiles_available() and w.shape[1] % 32 == 0:
        out["amx"] = functools.partial(ops.fixed_order_linear, x,
                                       ops.pack_linear_weight_amx(w), n)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--shapes", choices=["smollm2", "llama-1b"], default="smollm2")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    from int8_gemm import SHAPES
    shapes = SHAPES if args.shapes == "smollm2" else LLAMA_1B_SHAPES
    print(f"torch {torch.__version__}, {args.threads} threads, {args.dtype}, {args.shapes}")
    rows, peak = [], 0.0
    for name, k, n in shapes:
        w = torch.randn(n, k).to(dtype)
        for m in ROWS:
            x = torch.randn(m, k).to(dtype)
            calls, alone = routes(x, w), routes(x[:1], w)
            rates = {label: 2 * m * k * n / best_time(fn) / 1e9 for label, fn in calls.items()}
            invariant = {label: torch.equal(fn()[:1], alone[label]()) for label, fn in calls.items()}
            peak = max(peak, *(rates[label] for label in LIBRARIES if label in rates))
            rows.append((name, k, n, m, rates, invariant))
    labels = list(rows[0][4])
    print(f"{'shape':>8} {'K':>5} {'N':>6} {'M':>4} " + " ".join(f"{x:>7}" for x in labels)
          + "  ours/peak  invariant (" + " ".join(labels) + ")")
    for name, k, n, m, rates, invariant in rows:
        ours = max(rates[label] for label in ("fma", "pairs", "amx") if label in rates)
        print(f"{name:>8} {k:5d} {n:6d} {m:4d} " + " ".join(f"{rates[x]:7.1f}" for x in labels)
              + f"  {ours / peak:9.2f}  " + " ".join("y" if invariant[x] else "n" for x in labels))
    print(f"peak (best library rate of the run): {peak:.1f} GFLOP/s")


if __name__ == "__main__":
    main()
