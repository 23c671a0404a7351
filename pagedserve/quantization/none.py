"""``--quantization none``: every Linear computes from its float weight (GGUF weights
dequantized at load), the exact path.

On CPU, in float32 and bfloat16, each weight is packed once into panels for our
fixed-order GEMM (``torch.ops.pagedserve.fixed_order_linear``,
``csrc/fixed_order_gemm_cpu.cpp``): every output element is one chain of float32 FMAs over
K in order (for bfloat16, where ``kernel_choice`` measured it faster: on CPUs with
AVX512-BF16 one chain of ``vdpbf16ps`` over k-pairs, on CPUs with AMX one of ``TDPBF16PS``
over k-steps of 16 pairs), so a row of x gets the same bits alone as in a step of any
size, chunked or not (batch invariance by construction, where MKL and oneDNN choose
kernels and summation orders by the row count). The packed copy is the weight's size
again. Elsewhere (CUDA, float16, autograd, no C++ kernels) ``F.linear``. The other methods
keep their float layers here too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.cpu_ops import cpu_ops_available, load_cpu_ops
from pagedserve.quantization.base import (
    EMPTY,
    KIND_FLOAT,
    Linear,
    LoadContext,
    QuantizationMethod,
    linears,
)
from pagedserve.quantization.kernel_choice import bf16_layout

PACKED_DTYPES = (torch.float32, torch.bfloat16)


def float_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 packed: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, ``[..., K] -> [..., N]``: by the fixed-order GEMM from
    ``packed`` (``pack_weight``) without autograd, else ``F.linear``."""
    if packed is None or torch.is_grad_enabled():
        return F.linear(x, weight, bias)
    rows = x.numel() // x.shape[-1]
    out = torch.ops.pagedserve.fixed_order_linear(x.reshape(rows, -1), packed, weight.shape[0])
    out = out.view(*x.shape[:-1], -1)
    return out if bias is None else out + bias


def packing_available(device: str, dtype: torch.dtype) -> bool:
    """Whether ``pack_weight`` applies: float32 or bfloat16 weights on CPU, with our C++
    kernels built."""
    return device == "cpu" and dtype in PACKED_DTYPES and cpu_ops_available()


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` (float32 or bfloat16, CPU) packed for ``fixed_order_linear``:
    ``[ceil(N / P), K, P]``, P output columns a panel (16 with AVX2, 32 with AVX-512), zero
    past N; or, for a bfloat16 weight where ``kernel_choice`` picks the pair kernel,
    ``[ceil(N / 64), ceil(K / 2), 64, 2]``, or AMX tiles, ``[ceil(N / 64), K / 32, 16, 64,
    2]``."""
    ops, weight = load_cpu_ops(), weight.detach()
    layout = bf16_layout(*weight.shape) if weight.dtype == torch.bfloat16 else "fma"
    if layout == "amx":
        return ops.pack_linear_weight_amx(weight)
    if layout == "pairs":
        return ops.pack_linear_weight_pairs(weight)
    return ops.pack_linear_weight(weight)


@dataclass(frozen=True)
class FloatWeight:
    """The layer's float weight, with its packed copy where ``packing_available``."""

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
        return "float weights" + (", packed for the fixed-order GEMM"
                                  if packing_available(ctx.device, ctx.dtype) else "")
