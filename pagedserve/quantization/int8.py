"""INT8 W8A8 linear layers on CPU (``--quantization int8``).

Symmetric W8A8 quantization as in SmoothQuant (whose smoothing is ``smoothquant.py``):

- weights ``[N, K]`` are quantized once at load, per output channel (row n):
  ``scale[n] = max_k |w[n, k]| / 127``, ``q[n, k] = round(w[n, k] / scale[n])`` in [-127, 127];
- activations ``[M, K]`` are quantized the same way at run time, per token (row m), so a
  request's result never depends on the other rows of the batch (unlike FBGEMM's
  ``quantized::linear_dynamic``, which uses one scale for the whole batch);
- ``torch._int_mm(x_q [M, K], w_q.T [K, N])`` sums exactly in int32 (oneDNN, VNNI where the
  CPU has it) and ``acc * x_scale[m] * w_scale[n]`` (+ bias) gives the float result.

The weight stays ``[N, K]`` and is passed transposed: ``_int_mm`` was as fast or faster with
it than with a contiguous ``[K, N]`` copy at M = 1..256 on SmolLM2's shapes
(``benchmarks/README.md``). Our own product on a packed copy (``csrc/int8_ops_cpu.cpp``:
``vpdpbusd`` with AVX512-VNNI; ``vpmaddubsw`` and ``vpmaddwd`` with AVX2 alone, where
``_int_mm`` ran 20-40x slower; ``TDPBUSD`` tiles with AMX) sums the same int32s, so gives
the same bits; each weight shape runs whichever ``int8_kernel`` timed faster. The float
weight is dropped: a ``Linear`` holds the int8 rows as its ``weight`` (int8 parameter, so
memory accounting sees 1 byte per weight) and the pair as its ``method`` (``Int8Weight``). A
tied LM head keeps the float embedding (the token lookup needs it) and gets an int8 copy.
Layers named in ``quantize_model``'s ``skip`` stay in float.
``Int8Method`` first moves activation outliers into the weights (``smoothquant.py``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from pagedserve.cpu_ops import cpu_layer_ops, cpu_ops_available, load_cpu_ops
from pagedserve.quantization.base import KIND_INT8, Linear, LoadContext, QuantizationMethod, linears
from pagedserve.quantization.kernel_choice import (
    TIMED_COLUMNS,
    amx_applies,
    choose,
    time_routes,
)
from pagedserve.quantization.none import float_weight
from pagedserve.quantization.smoothquant import calibration_token_ids, smooth_model, smoothable

# Linear layers (last name part) left in float where SmoothQuant cannot run (see
# Int8Method). Measured on SmolLM2-135M (perplexity of the MT-Bench reference answers,
# benchmarks/README.md), without SmoothQuant: every Linear and the LM head in int8 cost
# +2.64% over float32, all but down_proj +1.92%, inside the 2% bound; with SmoothQuant
# every Linear in int8 costs +0.94%.
FLOAT_LAYERS = ("down_proj",)
_QMAX = 127.0
# The packed product sums (x + 128) * w in int32: at most 255 * 127 * K, below 2**31 up to
# K = 66,310 (csrc/int8_ops_cpu.cpp); a longer K stays on torch._int_mm.
PACKED_MAX_K = 65536
_TINY = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class Int8Weight:
    """A weight ``[N, K]`` as int8 ``qweight [N, K]`` and float32 ``scale [N]`` (one per
    output row): ``weight ~= qweight * scale[:, None]``, off by at most ``scale / 2``;
    ``packed``: qweight packed by ``pack_int8_weight`` (``[ceil(N / 64), ceil(K / 4) + 1,
    64, 4]`` int8) or ``pack_int8_weight_amx`` (``[ceil(N / 64), K / 64 + 1, 16, 64, 4]``)
    where a packed product runs, else None. A model's layers keep only
    one of the two (``quantize_model``): qweight is None beside a packed copy."""

    qweight: torch.Tensor | None
    scale: torch.Tensor
    packed: torch.Tensor | None = None

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return int8_linear(x, self, layer.bias)

    def fused_kernel(self, layer: Linear) -> tuple[torch.Tensor, torch.Tensor, int]:
        return (self.qweight if self.packed is None else self.packed), self.scale, KIND_INT8


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row quantization of ``x [R, K]`` (any float dtype): int8 ``[R, K]`` in
    [-127, 127] and float32 scales ``[R, 1]`` with ``x ~= q * scale``. A row of zeros gets
    scale 0 and zeros."""
    x = x.float()
    absmax = x.abs().amax(dim=-1, keepdim=True)
    scale = absmax / _QMAX
    q = torch.mul(x, _QMAX / absmax.clamp_(min=_TINY)).round_().to(torch.int8)
    return q, scale


@functools.cache
def int8_kernel(n: int, k: int) -> str:
    """``"amx"``, ``"packed"`` or ``"int_mm"``: the product an int8 weight ``[n, k]`` runs
    here, timed once per machine (``kernel_choice.choose``); always ``"int_mm"`` where the
    packed kernel is not built."""
    if not load_cpu_ops().packed_int8_available():
        return "int_mm"
    weight = lambda: torch.randint(-127, 128, (min(n, TIMED_COLUMNS), k), dtype=torch.int8)
    return choose(f"int8 [{n}, {k}]", f"int8 {n}x{k}", lambda: _time_int8(weight()))


def _time_int8(qweight: torch.Tensor) -> dict[str, float]:
    """Seconds per product of ``qweight`` by ``int8_linear``: on its rows (``torch._int_mm``)
    and on its packed copies (vector and, where they run, AMX tiles)."""
    scale = torch.ones(qweight.shape[0])
    weights = {"int_mm": Int8Weight(qweight, scale),
               "packed": Int8Weight(qweight, scale, load_cpu_ops().pack_int8_weight(qweight))}
    if amx_applies(qweight.shape[1], 64):
        weights["amx"] = Int8Weight(qweight, scale, load_cpu_ops().pack_int8_weight_amx(qweight))
    routes = {name: (lambda x, w=w: int8_linear(x, w)) for name, w in weights.items()}
    return time_routes(routes, qweight.shape[1])


def quantize_weight(weight: torch.Tensor) -> Int8Weight:
    """``weight [N, K]`` (float) -> ``Int8Weight`` with one scale per output row, packed
    where the packed product is the faster here."""
    q, scale = quantize_rows(weight)
    packed = None
    if q.device.type == "cpu" and q.shape[1] <= PACKED_MAX_K and cpu_ops_available():
        kernel = int8_kernel(*q.shape)
        if kernel == "packed":
            packed = load_cpu_ops().pack_int8_weight(q)
        elif kernel == "amx":
            packed = load_cpu_ops().pack_int8_weight_amx(q)
    return Int8Weight(q, scale.view(-1), packed)


def int8_linear(x: torch.Tensor, weight: Int8Weight,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ weight.T (+ bias) -> [..., N]`` in x's dtype, with ``x`` quantized per
    row (token) by ``quantize_rows`` and the product summed in int32 by ``torch._int_mm``.
    On CPU the quantization and the scaling run as two C++ passes with the same result, or
    with a packed weight all three in one call."""
    rows = x.numel() // x.shape[-1]
    x2d = x.reshape(rows, -1)
    ops = cpu_layer_ops(x)
    if ops is not None and weight.packed is not None:
        out = ops.int8_packed_linear(x2d, weight.packed, weight.scale, bias, weight.scale.numel())
        return out.view(*x.shape[:-1], -1)
    if ops is not None:  # the same arithmetic in one C++ pass each (csrc/int8_ops_cpu.cpp)
        q, scale = ops.quantize_rows_int8(x2d)
        acc = torch._int_mm(q, weight.qweight.t())
        out = ops.int8_scaled_mm_epilogue(acc, scale, weight.scale, bias, x.dtype)
        return out.view(*x.shape[:-1], -1)
    q, scale = quantize_rows(x2d)
    out = torch._int_mm(q, weight.qweight.t()).float().mul_(scale).mul_(weight.scale)
    if bias is not None:
        out.add_(bias)
    return out.to(x.dtype).view(*x.shape[:-1], -1)


def quantize_model(model: nn.Module, lm_head: bool = True,
                   skip: tuple[str, ...] = FLOAT_LAYERS) -> int:
    """Replace the weight of every ``Linear`` of ``model`` whose name does not end in one
    of ``skip`` by its int8 rows, or their packed copy (the LM head only if ``lm_head``; a
    tied one gets its own int8 copy, the embedding keeps its float table). Returns the
    number quantized (layers already int8 are left as they are)."""
    count = 0
    for name, layer in linears(model):
        if isinstance(layer.method, Int8Weight):  # quantized by an earlier call
            continue
        if name.split(".")[-1] not in skip and (lm_head or name != "lm_head"):
            method = quantize_weight(layer.weight.detach())
            if method.packed is not None:  # the rows' bytes held once, as the packed copy
                method = Int8Weight(None, method.scale, method.packed)
            layer.method = method
            layer.weight = nn.Parameter(method.qweight if method.packed is None else method.packed,
                                        requires_grad=False)
            count += 1
    return count


class Int8Method(QuantizationMethod):
    """``--quantization int8`` (CPU only): SmoothQuant (``smoothquant.py``, calibration
    chats cut to ``max_model_len`` tokens) and then every Linear in int8, where every layer
    could be smoothed; else (other layer kinds, or tensor parallel, whose ranks cannot run
    a calibration prefill alone) ``FLOAT_LAYERS`` stay float and nothing is smoothed."""

    name = "int8"
    cpu_only = True

    def process_model(self, model: nn.Module, ctx: LoadContext) -> str:
        smoothed = 0
        if ctx.prefill is not None and smoothable(model):
            calibration = [ids[:ctx.max_model_len]
                           for ids in calibration_token_ids(ctx.tokenizer())]
            smoothed = smooth_model(model, calibration, ctx.prefill)
        count = quantize_model(model, skip=() if smoothed else FLOAT_LAYERS)
        for _, layer in linears(model):
            if not isinstance(layer.method, Int8Weight):
                layer.method = float_weight(layer, ctx)
        return (f"{count} weights quantized to int8 (W8A8; "
                + ("SmoothQuant on every layer)" if smoothed else
                   f"no SmoothQuant, {', '.join(FLOAT_LAYERS)} left in float)"))
