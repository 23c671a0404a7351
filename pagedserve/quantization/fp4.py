"""``--quantization mxfp4`` and ``--quantization nvfp4``: 4-bit floating-point weights
(formats: ``fp4_formats.py``). On CUDA each weight is quantized at load and multiplied by
a Triton GEMM that decodes its blocks (``fp4_triton.py``); the rest of this docstring is
about CPU.

On CPU each Linear's weight is held in FP4 blocks and every step, prefill and decode, multiplies
by them with 8-bit activations in the GGUF block kernel (``ggml_mul_mat_a8``, types 39 and
40), as the Q4_1 path does: E2M1 codes become integers through a 16-entry table lookup and
meet the activations in integer dot products, the scales applied per block. Like every
block path, a row gets the same bits alone as in a batch (each row quantized on its own,
blocks summed in one order).

Where the weights come from: a GGUF file whose tensors are ggml's ``MXFP4`` / ``NVFP4``
keeps them as they are (the default ``gguf`` method takes those too); any other weight,
from safetensors or a GGUF file of another type, is quantized at load from the model's
float weight (round to nearest, ties to even, each block's scale the format's rule's or a
neighbour of lower squared error: ``fp4_formats.py``). A weight the
kernel cannot take (rows not a multiple of 16, columns not of 32) stays in float. The
NVFP4 tensor scale is per Linear (a fused qkv or gate_up projection is one tensor here).

Before quantizing at load, SmoothQuant (``smoothquant.py``, as the int8 path) scales each
layer's input channels where the model allows it (plain pre-norm layers, one rank, no
blocks taken from the file): a weight's columns that meet large activations are scaled up
and so quantized with a smaller relative error. Measured on the bundled model, perplexity
of held-out text over float32 (``benchmarks/quant_accuracy.py``): NVFP4 +25.0% without,
+15.1% at the int8 strengths (0.7 / 0.5; 0.5 / 0.5: +17.7%); MXFP4 +66.9% without,
+59.6% at 0.5 / 0.5 (0.7 / 0.5: +84.8%). Each format keeps its best.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable

import torch
from gguf import GGMLQuantizationType
from torch import nn

from pagedserve.model_loader.gguf_file import iter_gguf_blocks
from pagedserve.quantization.base import Linear, LoadContext, QuantizationMethod, linears
from pagedserve.quantization.fp4_formats import (
    MXFP4,
    NVFP4,
    TILE_ROWS,
    kernel_tile_bytes,
    nvfp4_kernel_rows,
    quantize_mxfp4,
    quantize_nvfp4,
)
from pagedserve.quantization.gguf import GGUFWeight, find_blocks, hold_blocks, repack_blocks
from pagedserve.quantization.none import float_weight
from pagedserve.quantization.smoothquant import calibration_token_ids, smooth_model, smoothable


def mxfp4_weight(weight: torch.Tensor) -> GGUFWeight:
    """``weight [N, K]`` quantized to MXFP4 in the kernel's layout."""
    return GGUFWeight(repack_blocks(quantize_mxfp4(weight), MXFP4), MXFP4)


def nvfp4_weight(weight: torch.Tensor) -> GGUFWeight:
    """``weight [N, K]`` quantized to NVFP4 in the kernel's layout (the kernel multiplies
    halved block scales by doubled elements; halving an E4M3 value is exact in fp16)."""
    codes, scales, global_scale = quantize_nvfp4(weight)
    rows = nvfp4_kernel_rows(codes, scales.float() * 0.5, global_scale.expand(weight.shape[0]))
    return GGUFWeight(rows, NVFP4)


def kernel_takes(layer: Linear) -> bool:
    """Whether the block kernel takes this layer's weight shape."""
    n, k = layer.weight.shape
    return n % TILE_ROWS == 0 and k % 32 == 0


class FP4Method(QuantizationMethod):
    """Every Linear the kernel takes in FP4 blocks of ``qtype`` (``GGUFWeight``), the
    others in float."""

    needs_cpu_ops = True  # the quantizer (csrc/fp4_quant_cpu.cpp), on any device
    qtype: GGMLQuantizationType
    smoothing: tuple[float, float]  # SmoothQuant's alpha for norm-fed projections, down_proj
    quantize: Callable[[torch.Tensor], GGUFWeight]  # mxfp4_weight or nvfp4_weight
    triton_name: str  # the CUDA quantizer's name in fp4_triton.py

    def take_stored_weights(self, model: nn.Module, ctx: LoadContext) -> set[str]:
        """The file's own blocks of this format, for the modules whose shape they match (a
        tensor-parallel rank holds a shard: it quantizes its shard instead). Not on CUDA,
        whose kernel has its own layout (the file's values are quantized again, value for
        value)."""
        if pathlib.Path(ctx.model_path).suffix.lower() != ".gguf" or ctx.device != "cpu":
            return set()
        found = find_blocks(model, iter_gguf_blocks(ctx.model_path, (self.qtype,)))
        held = {module: stored for module, stored in found.items()
                if stored.qweight.shape[0] * TILE_ROWS == module.weight.shape[0]
                and stored.qweight.shape[1] == kernel_tile_bytes(stored.qtype,
                                                                 module.weight.shape[1])}
        return hold_blocks(model, held, ctx.dtype)

    def process_model(self, model: nn.Module, ctx: LoadContext) -> str:
        stored = [layer for _, layer in linears(model) if isinstance(layer.method, GGUFWeight)]
        smoothed = not stored and ctx.prefill is not None and smoothable(model)
        if smoothed:
            calibration = [ids[:ctx.max_model_len]
                           for ids in calibration_token_ids(ctx.tokenizer())]
            smooth_model(model, calibration, ctx.prefill, *self.smoothing)
        quantize = self.quantize if ctx.device == "cpu" else self._triton_quantizer()
        counts = {"from the file": len(stored), "quantized at load": 0, "kept in float": 0}
        for _, layer in linears(model):
            if isinstance(layer.method, GGUFWeight):
                continue
            if kernel_takes(layer):
                layer.method = quantize(layer.weight)
                layer.weight = nn.Parameter(layer.method.qweight, requires_grad=False)
                counts["quantized at load"] += 1
            else:
                layer.method = float_weight(layer, ctx)
                counts["kept in float"] += 1
        return (f"{self.name} weights: " + ", ".join(f"{n} {kind}" for kind, n in counts.items())
                + (" (after SmoothQuant)" if smoothed else ""))

    def _triton_quantizer(self) -> Callable:
        """The CUDA weights' quantizer; raises ValueError without the triton package."""
        try:
            from pagedserve.quantization import fp4_triton
        except ImportError as e:
            raise ValueError(f"quantization {self.name!r} on CUDA needs the triton package "
                             f"({e})") from e
        return getattr(fp4_triton, self.triton_name)


class MXFP4Method(FP4Method):
    name, qtype, smoothing = "mxfp4", MXFP4, (0.5, 0.5)
    quantize, triton_name = staticmethod(mxfp4_weight), "triton_mxfp4_weight"


class NVFP4Method(FP4Method):
    name, qtype, smoothing = "nvfp4", NVFP4, (0.7, 0.5)
    quantize, triton_name = staticmethod(nvfp4_weight), "triton_nvfp4_weight"
