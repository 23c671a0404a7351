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

Only the blocks are kept: the layers take them from the file before the float weights load
(``take_stored_weights``), so those tensors are never dequantized, and the embedding, where
the file stores it in a kernel type, looks its rows up in its blocks (``GGUFEmbedding``,
bit-equal to the float table it replaces). The bundled model then holds 96 MB of weights
instead of 366 MB (bfloat16; float32: 640 MB).
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
        out = gguf_mm(x.reshape(rows, -1), self).to(x.dtype).view(*x.shape[:-1], -1)
        return out if layer.bias is None else out + layer.bias

    def fused_kernel(self, layer: Linear) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.qweight, EMPTY, int(self.qtype)


def gguf_mm(x: torch.Tensor, weight: GGUFWeight) -> torch.Tensor:
    """``x [M, K] @ W.T -> [M, N]`` from the blocks, x rounded to 8 bits per block of 32;
    in x's dtype for float32 and bfloat16 (the kernel reads and writes both), else in
    float32."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        x = x.float()
    return torch.ops.pagedserve.ggml_mul_mat_a8(weight.qweight, x, int(weight.qtype))


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


@dataclass(frozen=True)
class StoredBlocks:
    """A module's weight as the file stores it: the repacked blocks (``repack_blocks``),
    their type, and the checkpoint tensors (HF names) they were made of."""

    qweight: torch.Tensor
    qtype: GGMLQuantizationType
    names: tuple[str, ...]


def find_blocks(model: nn.Module,
                blocks: Iterable[tuple[str, GGMLQuantizationType, torch.Tensor]]
                ) -> dict[nn.Module, StoredBlocks]:
    """The repacked GGUF blocks of each ``Linear`` of ``model`` that has them, and of its
    embedding (``embed_tokens``); a tied LM head's are the embedding's (one tensor).

    ``blocks`` holds (HF name, type, rows) as ``gguf_file.iter_gguf_blocks`` yields them.
    A fused layer (qkv_proj, gate_up_proj) gets its checkpoint tensors' rows concatenated in
    ``model.checkpoint_names`` order, only if all are there with one type and the kernel
    takes their row count (a multiple of 16).
    """
    modules: dict[tuple[str, ...], list[nn.Module]] = {}  # checkpoint parts -> modules
    for name, module in [("embed_tokens", model.embed_tokens), *linears(model)]:
        modules.setdefault(tuple(model.checkpoint_names(name)), []).append(module)
    parts_of = {part: parts for parts in modules for part in parts}
    # Streamed: a module's rows are repacked as soon as its parts are read, so only one
    # layer's file rows are held at a time (all at once held the file twice over).
    pending: dict[tuple[str, ...], dict] = {}
    held = {}
    for name, qtype, rows in blocks:
        part = name.removeprefix("model.").removesuffix(".weight")
        if part not in parts_of:
            continue
        parts = parts_of[part]
        found = pending.setdefault(parts, {})
        found[part] = (name, qtype, rows)
        if len(found) == len(parts):
            stored = _concat_rows(pending.pop(parts), parts)
            held.update((module, stored) for module in modules[parts] if stored is not None)
    return held


def _concat_rows(found: dict[str, tuple[str, GGMLQuantizationType, torch.Tensor]],
                 parts: tuple[str, ...]) -> StoredBlocks | None:
    stored = [found.get(n) for n in parts]
    if any(p is None for p in stored) or len({qtype for _, qtype, _ in stored}) != 1:
        return None
    qtype = stored[0][1]
    rows = torch.cat([rows for _, _, rows in stored])
    if rows.shape[0] % TILE_ROWS:
        return None
    return StoredBlocks(repack_blocks(rows, qtype), qtype, tuple(n for n, _, _ in stored))


class GGUFEmbedding(nn.Module):
    """An embedding table ``[vocab, hidden]`` kept as blocks in the kernel's layout: token
    ids ``[...]`` -> rows ``[..., hidden]`` in ``dtype``, each dequantized to float32 by
    ``ggml_get_rows`` (Q4_1 and Q8_0 bit-equal to the loader's dequantization) and cast, as
    the float table would hold them. ``weight`` is the blocks (uint8)."""

    def __init__(self, weight: nn.Parameter, qtype: GGMLQuantizationType,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.weight, self.qtype, self.dtype = weight, qtype, dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = torch.ops.pagedserve.ggml_get_rows(self.weight, input_ids.reshape(-1),
                                                  int(self.qtype))
        return rows.to(self.dtype).view(*input_ids.shape, -1)


def hold_blocks(model: nn.Module, held: dict[nn.Module, StoredBlocks], dtype: torch.dtype
                ) -> set[str]:
    """Give each module of ``held`` (``find_blocks``) its blocks: a ``Linear`` a
    ``GGUFWeight`` whose blocks become its ``weight`` parameter (uint8; the float one is
    dropped), the embedding a ``GGUFEmbedding`` in its place (a tied LM head keeps sharing
    that parameter). Returns the checkpoint tensors now held (HF names)."""
    params: dict[int, nn.Parameter] = {}
    for module, stored in held.items():
        param = params.setdefault(id(stored.qweight),
                                  nn.Parameter(stored.qweight, requires_grad=False))
        if module is model.embed_tokens:
            model.embed_tokens = GGUFEmbedding(param, stored.qtype, dtype)
        else:
            module.method = GGUFWeight(stored.qweight, stored.qtype)
            module.weight = param
    return {name for stored in held.values() for name in stored.names}


class GGUFMethod(QuantizationMethod):
    """Each Linear whose weight the GGUF file holds in a ``KERNEL_TYPES`` type gets a
    ``GGUFWeight`` (the embedding a ``GGUFEmbedding``) before the float weights load; the
    others compute in float (``none.FloatWeight``)."""

    name = "gguf"

    def take_stored_weights(self, model: nn.Module, ctx: LoadContext) -> set[str]:
        held = find_blocks(model, iter_gguf_blocks(ctx.model_path, KERNEL_TYPES))
        return hold_blocks(model, held, ctx.dtype)

    def process_model(self, model: nn.Module, ctx: LoadContext) -> str:
        count = 0
        for _, layer in linears(model):
            if isinstance(layer.method, GGUFWeight):
                count += 1
            else:
                layer.method = float_weight(layer, ctx)
        embedding = ("; the embedding from its blocks"
                     if isinstance(model.embed_tokens, GGUFEmbedding) else "")
        return f"{count} weights computed from their GGUF blocks{embedding}"
