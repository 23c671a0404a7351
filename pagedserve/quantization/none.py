"""``--quantization none``: every Linear computes from its float weight (GGUF weights
dequantized at load), the exact path.

On CPU in float32 each weight is also packed once for MKL's packed SGEMM (``pack_weight``)
for steps of ``PACKED_MIN_ROWS`` rows or more; weights wider than ``COLUMN_CHUNK`` output
features (an MLP's fused gate/up, the LM head) are otherwise multiplied in slices of that
many output columns, each written into its place of one output tensor: MKL is 5-50% faster
on the slices at 64-256 rows (``benchmarks/README.md``). The other methods keep their float
layers (and their fallback for large steps) here too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.quantization.base import (
    EMPTY,
    KIND_FLOAT,
    Linear,
    LoadContext,
    QuantizationMethod,
    linears,
)

# Fewest rows computed from an MKL-packed float32 weight (pack_weight), the threshold it was
# measured and tested with; smaller steps run F.linear.
PACKED_MIN_ROWS = 17
# Output columns per torch.mm for wider CPU weights. Measured on an AVX2 Zen 3 with 2
# threads, MKL 2024.2, K = 576: N = 49,152 runs at 62 / 83 / 93 GFLOP/s whole and
# 97 / 111 / 116 in 2048-column slices at M = 64 / 128 / 256 rows; N = 3,072 gains 5-15%;
# at 1,024 rows both are the same.
COLUMN_CHUNK = 2048


def float_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 packed: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, ``[..., K] -> [..., N]``: from ``packed``
    (``pack_weight``) for ``PACKED_MIN_ROWS`` rows or more without autograd; else by
    ``column_chunked_mm`` for a CPU weight wider than ``COLUMN_CHUNK`` without autograd;
    else ``F.linear``."""
    rows = x.numel() // x.shape[-1]
    if packed is not None and rows >= PACKED_MIN_ROWS and not torch.is_grad_enabled():
        # Told the step's own row count, MKL computes from the packed weight (told another,
        # PyTorch silently falls back to an unpacked GEMM).
        out = torch.ops.mkl._mkl_linear(x.reshape(rows, -1), packed, weight, bias, rows)
        return out.view(*x.shape[:-1], -1)
    if weight.shape[0] > COLUMN_CHUNK and weight.is_cpu and not torch.is_grad_enabled():
        out = column_chunked_mm(x.reshape(rows, -1), weight).view(*x.shape[:-1], -1)
        return out if bias is None else out + bias
    return F.linear(x, weight, bias)


def column_chunked_mm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for x ``[M, K]`` and weight ``[N, K]`` -> ``[M, N]``, as one
    ``torch.mm`` per ``COLUMN_CHUNK`` rows of weight into slices of the output (``out=``:
    not differentiable, so only without autograd)."""
    n = weight.shape[0]
    out = x.new_empty(x.shape[0], n)
    for start in range(0, n, COLUMN_CHUNK):
        stop = min(start + COLUMN_CHUNK, n)
        torch.mm(x, weight[start:stop].t(), out=out[:, start:stop])
    return out


def packing_available(device: str, dtype: torch.dtype) -> bool:
    """Whether ``pack_weight`` applies: float32 weights on CPU with PyTorch's MKL."""
    return device == "cpu" and dtype == torch.float32 and torch.backends.mkl.is_available()


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` (float32, CPU) packed once for MKL's packed SGEMM
    (``cblas_sgemm_pack``, through ``torch.ops.mkl``; inductor's ``freezing`` does the same).

    Why: ``F.linear`` lets MKL pack the weight on every call; packed once, the shared
    workload ran 1.21x faster (1.7x on a 32-request run; ``benchmarks/README.md``). From
    ``PACKED_MIN_ROWS`` rows up the result is as close to float64 as ``F.linear``'s and on
    many shapes bit-equal to it (tested on one), not on all: SmolLM2's down_proj (K = 1536)
    differs in the last bit at 57-128 rows, a different summation order. The price is memory:
    PyTorch allocates 2-9x the weight's bytes for the packed buffer, of which fewer pages
    are touched (SmolLM2-135M in float32: peak RSS 1.03 -> 1.51 GB)."""
    return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), 64)


@dataclass(frozen=True)
class FloatWeight:
    """The layer's float weight, with its MKL-packed copy where ``packing_available``."""

    packed: torch.Tensor | None = None

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return float_linear(x, layer.weight, layer.bias, self.packed)

    def fused_kernel(self, layer: Linear) -> tuple[torch.Tensor, torch.Tensor, int]:
        return layer.weight.detach(), EMPTY if self.packed is None else self.packed, KIND_FLOAT


def float_weight(layer: Linear, ctx: LoadContext) -> FloatWeight:
    """What a layer kept in float holds: its weight, packed where that applies."""
    packable = packing_available(ctx.device, ctx.dtype)
    return FloatWeight(pack_weight(layer.weight) if packable else None)


class NoneMethod(QuantizationMethod):
    """Every Linear in float (``FloatWeight``)."""

    name = "none"

    def process_model(self, model: nn.Module, ctx: LoadContext) -> str:
        for _, layer in linears(model):
            layer.method = float_weight(layer, ctx)
        return "float weights" + (", packed for MKL" if packing_available(ctx.device, ctx.dtype)
                                  else "")
