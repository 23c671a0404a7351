"""GGUF block kernels on CPU: the default for GGUF models (``--quantization`` unset or
``gguf``). Weights stored as Q4_1, Q8_0, MXFP4 or NVFP4 keep their GGUF blocks (NVFP4's
converted to the kernel's rows, ``fp4_formats.py``), and every step
multiplies by the blocks directly, with 8-bit activations (``torch.ops.pagedserve.
ggml_mul_mat_a8``, ``csrc/gguf_gemm_cpu.cpp``), as llama.cpp's CPU backend and vLLM's GGUF
kernels (``ggml_mul_mat_vec_a8``) do.

Why: at batch 1 a decode step is bound by reading the weights, and the blocks are 3.2x
(Q8_0) to 6.4x (Q4_1) smaller than float32; integer dot products on 8-bit activations
keep the kernel at the memory's pace where dequantizing to float32 did not (a lone request's
weight reads went 12.5 -> 8 ms a token), and at tens of rows they do 4x the multiply-adds
of a float32 FMA per instruction. The price is the activations' rounding to 8 bits per
block of 32: not token-exact with float32 (``benchmarks/README.md`` gives perplexity and
greedy agreement). Every step, prefills too: each row is quantized on its own and its
products summed block after block in one order, so a row gets the same bits alone as in a
batch, and a prompt the same chunked or not (a switch to float weights above some row count
would break both). Any model dtype: the kernels take float32 rows, so bfloat16 steps
convert theirs; a lone request then reads 4-bit weights in bfloat16 too, instead of 16-bit
ones.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType
from torch import nn

from pagedserve.cpu_ops import load_cpu_ops
from pagedserve.model_loader.gguf_file import iter_gguf_blocks
from pagedserve.quantization.base import EMPTY, Linear, LoadContext, QuantizationMethod, linears
from pagedserve.quantization.fp4_formats import nvfp4_ggml_to_kernel
from pagedserve.quantization.none import float_weight

logger = logging.getLogger(__name__)

# The block types the kernel reads.
KERNEL_TYPES = (GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0,
                GGMLQuantizationType.MXFP4, GGMLQuantizationType.NVFP4)
TILE_ROWS = 16  # output rows per tile of the kernel's layout


@dataclass(frozen=True)
class GGUFWeight:
    """A weight ``[N, K]`` as blocks in the kernel's layout (``repack_blocks``): ``qweight``
    uint8 ``[N / 16, tile bytes]``, ``qtype`` one of ``KERNEL_TYPES``."""

    qweight: torch.Tensor
    qtype: GGMLQuantizationType

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        # The kernel takes float32 (a no-op in float32).
        out = gguf_mm(x.reshape(rows, -1), self).to(x.dtype).view(*x.shape[:-1], -1)
        return out if layer.bias is None else out + layer.bias

    def fused_kernel(self, layer: Linear) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.qweight, EMPTY, int(self.qtype)


def gguf_mm(x: torch.Tensor, weight: GGUFWeight) -> torch.Tensor:
    """``x [M, K] @ W.T -> [M, N]`` float32 from the blocks, x rounded to 8 bits per
    block of 32."""
    return torch.ops.pagedserve.ggml_mul_mat_a8(weight.qweight, x.float(), int(weight.qtype))


def repack_blocks(rows: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """GGUF rows uint8 ``[N, K / 32 * type_size]`` (N a multiple of 16) reordered for
    ``ggml_mul_mat_a8``: in tiles of 16 rows, and per tile block after block, the 16 rows'
    scales d, then (Q4_1) their mins m, then their quants in chunks of 4 bytes, chunk-major
    (``[chunk][row][4 bytes]``). The same bytes, moved so that one 64-byte load holds 4
    quant bytes of each of 16 rows (layout: ``csrc/gguf_gemm_cpu.cpp``), by the C++ op
    ``repack_gguf_blocks``. Returns uint8 ``[N / 16, K / 32 * 16 * type_size]`` (MXFP4: a
    tile's scales first, padded to 64 bytes, then its quants); raises RuntimeError for
    another type or row count. ggml's NVFP4 rows (blocks of 64) become
    the kernel's own NVFP4 tiles instead (``fp4_formats.nvfp4_ggml_to_kernel``)."""
    if qtype == GGMLQuantizationType.NVFP4:
        return nvfp4_ggml_to_kernel(rows)
    return load_cpu_ops().repack_gguf_blocks(rows, int(qtype))


def find_blocks(model: nn.Module,
                blocks: Iterable[tuple[str, GGMLQuantizationType, torch.Tensor]]
                ) -> dict[Linear, tuple[torch.Tensor, GGMLQuantizationType]]:
    """The repacked GGUF blocks (``repack_blocks``) of each ``Linear`` of ``model`` that
    has them; a tied LM head's are the embedding's.

    ``blocks`` holds (HF name, type, rows) as ``gguf_file.iter_gguf_blocks`` yields them.
    A fused layer (qkv_proj, gate_up_proj) gets its checkpoint tensors' rows concatenated in
    ``model.checkpoint_names`` order, only if all are there with one type and the kernel
    takes their row count (a multiple of 16).
    """
    found = {name.removeprefix("model.").removesuffix(".weight"): (qtype, rows)
             for name, qtype, rows in blocks}
    held = {}
    for name, layer in linears(model):
        parts = _concat_rows(found, model.checkpoint_names(name))
        if parts is not None:
            held[layer] = parts
    return held


def _concat_rows(found: dict[str, tuple[GGMLQuantizationType, torch.Tensor]],
                 names: list[str]) -> tuple[torch.Tensor, GGMLQuantizationType] | None:
    parts = [found.get(n) for n in names]
    if any(p is None for p in parts) or len({qtype for qtype, _ in parts}) != 1:
        return None
    qtype = parts[0][0]
    rows = torch.cat([rows for _, rows in parts])
    if rows.shape[0] % TILE_ROWS:
        return None
    return repack_blocks(rows, qtype), qtype


class GGUFMethod(QuantizationMethod):
    """Each Linear whose weight the GGUF file holds in a ``KERNEL_TYPES`` type gets a
    ``GGUFWeight``; the others compute in float (``none.FloatWeight``)."""

    name = "gguf"

    def process_model(self, model: nn.Module, ctx: LoadContext) -> str:
        held = find_blocks(model, iter_gguf_blocks(ctx.model_path, KERNEL_TYPES))
        for _, layer in linears(model):
            layer.method = GGUFWeight(*held[layer]) if layer in held else float_weight(layer, ctx)
        return f"{len(held)} weights computed from their GGUF blocks"
