"""Weights packed once at load vs ``F.linear`` (which lets MKL pack the weight on every
call), float32, on SmolLM2-135M's shapes: issue 13's question of whether packing is where
vLLM's CPU GEMMs gain. Library routes only: PyTorch's own ``torch.ops.mkl._mkl_linear``
(MKL ``cblas_sgemm_pack`` / ``compute``, what inductor's ``freezing`` emits for float32)
and ``torch.ops.mkldnn._linear_pointwise`` on a oneDNN-reordered weight; beside them our
fixed-order GEMM (``torch.ops.pagedserve.fixed_order_linear``, what float weights run on
CPU: batch-invariant by construction).

    PYTHONPATH=. python benchmarks/packed_gemm.py [--threads N]

Columns, in GFLOP/s of ``2 * M * K * N``, best of 5 timings: ``linear`` = ``F.linear``;
``mkl`` = the MKL-packed weight (packed once for 64 rows, called with the step's own row
count: PyTorch falls back to an unpacked GEMM when that count differs from the one it is
told); ``onednn`` = the oneDNN-packed weight; ``fixed`` = ours. ``=`` marks results
bit-equal to ``F.linear``; ``packed x`` = bytes of the MKL-packed weight / bytes of the
weight; ``invariant`` = whether each library's row 0 equals its 1-row product (ours is by
construction).
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from int8_gemm import ROWS, SHAPES, best_time

from pagedserve.cpu_ops import load_cpu_ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads")
    ops = load_cpu_ops()
    print(f"{'shape':>8} {'K':>5} {'N':>6} {'M':>4} {'linear':>7} {'mkl':>9} {'onednn':>9} "
          f"{'fixed':>9} {'packed x':>8}  invariant (linear mkl onednn fixed)")
    for name, k, n in SHAPES:
        w = torch.randn(n, k)
        mkl_w = torch.ops.mkl._mkl_reorder_linear_weight(w, 64)
        dnn_w = torch.ops.mkldnn._reorder_linear_weight(w, 64)
        fixed_w = ops.pack_linear_weight(w)
        for m in ROWS:
            x = torch.randn(m, k)
            runs = {
                "linear": functools.partial(F.linear, x, w),
                "mkl": functools.partial(torch.ops.mkl._mkl_linear, x, mkl_w, w, None, m),
                "onednn": functools.partial(torch.ops.mkldnn._linear_pointwise, x, dnn_w, None,
                                            "none", [], ""),
                "fixed": functools.partial(ops.fixed_order_linear, x, fixed_w, n),
            }
            alone = {  # the same routes on row 0 alone
                "linear": functools.partial(F.linear, x[:1], w),
                "mkl": functools.partial(torch.ops.mkl._mkl_linear, x[:1], mkl_w, w, None, 1),
                "onednn": functools.partial(torch.ops.mkldnn._linear_pointwise, x[:1], dnn_w,
                                            None, "none", [], ""),
                "fixed": functools.partial(ops.fixed_order_linear, x[:1], fixed_w, n),
            }
            ref = runs["linear"]()
            cells, invariant = [], []
            for label, fn in runs.items():
                rate = 2 * m * k * n / best_time(fn) / 1e9
                out = fn()
                mark = "=" if label != "linear" and torch.equal(out, ref) else " "
                cells.append(f"{rate:7.1f}{mark}")
                invariant.append("y" if torch.equal(out[:1], alone[label]()) else "n")
            print(f"{name:>8} {k:5d} {n:6d} {m:4d} {cells[0]:>7} {cells[1]:>9} {cells[2]:>9} "
                  f"{cells[3]:>9} {mkl_w.numel() / w.numel():8.2f}  {' '.join(invariant)}")


if __name__ == "__main__":
    main()
