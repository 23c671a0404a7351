"""Linear layers on CPU. GGUF-quantized weights stored as Q4_1 or Q8_0 keep their GGUF
blocks, and steps with few tokens multiply by the blocks directly, with 8-bit activations
(``torch.ops.pagedserve.ggml_mul_mat_a8``, ``csrc/gguf_gemm_cpu.cpp``), as llama.cpp's CPU
backend and vLLM's GGUF kernels (``ggml_mul_mat_vec_a8``) do.

Why: at batch 1 a decode step is bound by reading the weights, and the blocks are 3.2x
(Q8_0) to 6.4x (Q4_1) smaller than float32; integer dot products on 8-bit activations
keep the kernel at the memory's pace where dequantizing to float32 did not (a lone request's
weight reads went 12.5 -> 8 ms a token), and at tens of rows they do 4x the multiply-adds
of a float32 FMA per instruction. The price is the activations' rounding to 8 bits per
block of 32: not token-exact with float32 (``benchmarks/README.md`` gives perplexity and
greedy agreement). Steps of more than ``MAX_ROWS`` tokens (prefills) run MKL on the
float32 weights, which layers keep as well.

On by default for GGUF models on CPU, in any dtype (``--quantization`` unset or ``gguf``);
``--quantization none`` computes from dequantized float32 weights only (exact);
``--quantization int8`` replaces the weights by int8 ones instead (``int8.py``, any
checkpoint, CPU only).

Weights wider than ``COLUMN_CHUNK`` output features (an MLP's fused gate/up, the LM head)
are multiplied on CPU in slices of that many output columns, each written into its place
of one output tensor: MKL is 5-50% faster on the slices at 64-256 rows (``benchmarks/README.md``).
"""

from __future__ import annotations

import logging
import pathlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from pagedserve.cpu_ops import cpu_ops_available, load_cpu_ops
from pagedserve.quantization.int8 import Int8Weight, int8_linear

logger = logging.getLogger(__name__)

# The block types the kernel reads.
KERNEL_TYPES = (GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0)
# Most rows of x computed from the blocks (a decode step of up to 64 sequences); above it
# MKL on the float32 weights. One decode step's GEMMs of SmolLM2-135M, AVX-512 VNNI Ice
# Lake, 2 threads: 5.5 / 14 / 28 / 58 ms from the blocks vs - / 39 / 50 / 82 ms MKL at
# 1 / 16 / 32 / 64 rows; the AVX2 path against MKL limited to AVX2: 34 vs 59 ms at 16
# rows, 145 vs 150 at 64 (benchmarks/README.md).
MAX_ROWS = 64
# Fewest rows computed from an MKL-packed float32 weight (pack_weight), the threshold it was
# measured and tested with; smaller steps run F.linear. Not tied to MAX_ROWS: a float weight
# without GGUF blocks (--quantization none, int8's down_proj) uses the packed one at 17-64
# rows too, as before MAX_ROWS went from 16 to 64.
PACKED_MIN_ROWS = 17
QUANTIZATION_CHOICES = ("gguf", "int8", "none")
# Output columns per torch.mm for wider CPU weights. Measured on an AVX2 Zen 3 with 2
# threads, MKL 2024.2, K = 576: N = 49,152 runs at 62 / 83 / 93 GFLOP/s whole and
# 97 / 111 / 116 in 2048-column slices at M = 64 / 128 / 256 rows; N = 3,072 gains 5-15%;
# at 1,024 rows both are the same.
COLUMN_CHUNK = 2048


TILE_ROWS = 16  # output rows per tile of the kernel's layout


@dataclass(frozen=True)
class GGUFWeight:
    """A weight ``[N, K]`` as GGUF blocks in the kernel's layout (``repack_blocks``):
    ``qweight`` uint8 ``[N / 16, K / 32 * 16 * type_size]``, ``qtype`` one of
    ``KERNEL_TYPES``."""

    qweight: torch.Tensor
    qtype: GGMLQuantizationType


def repack_blocks(rows: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """GGUF rows uint8 ``[N, K / 32 * type_size]`` (N a multiple of 16) reordered for
    ``ggml_mul_mat_a8``: in tiles of 16 rows, and per tile block after block, the 16 rows'
    scales d, then (Q4_1) their mins m, then their quants in chunks of 4 bytes, chunk-major
    (``[chunk][row][4 bytes]``). The same bytes, moved so that one 64-byte load holds 4
    quant bytes of each of 16 rows (layout: ``csrc/gguf_gemm_cpu.cpp``), by the C++ op
    ``repack_gguf_blocks``. Returns uint8 ``[N / 16, K / 32 * 16 * type_size]``; raises
    RuntimeError for another type or row count."""
    return load_cpu_ops().repack_gguf_blocks(rows, int(qtype))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           quant: GGUFWeight | Int8Weight | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, ``[..., K] -> [..., N]``: by ``int8_linear`` for an
    ``Int8Weight`` quant (then ``weight`` is unused); from ``quant`` (the same weight as GGUF
    blocks) when x has at most ``MAX_ROWS`` rows; else from ``packed`` (``pack_weight``)
    for ``PACKED_MIN_ROWS`` rows or more without autograd; else by ``column_chunked_mm``
    for a CPU weight wider than ``COLUMN_CHUNK`` without autograd."""
    if isinstance(quant, Int8Weight):
        return int8_linear(x, quant, bias)
    rows = x.numel() // x.shape[-1]
    if quant is not None and rows <= MAX_ROWS:
        # The kernel takes float32; bfloat16 / float16 rows are few here, so converting
        # them costs little next to reading the weights (a no-op in float32).
        out = torch.ops.pagedserve.ggml_mul_mat_a8(quant.qweight, x.reshape(rows, -1).float(),
                                                   int(quant.qtype)).to(x.dtype)
    elif packed is not None and rows >= PACKED_MIN_ROWS and not torch.is_grad_enabled():
        # Told the step's own row count, MKL computes from the packed weight (told another,
        # PyTorch silently falls back to an unpacked GEMM).
        out = torch.ops.mkl._mkl_linear(x.reshape(rows, -1), packed, weight, bias, rows)
        return out.view(*x.shape[:-1], -1)
    elif weight.shape[0] > COLUMN_CHUNK and weight.is_cpu and not torch.is_grad_enabled():
        out = column_chunked_mm(x.reshape(rows, -1), weight)
    else:
        return F.linear(x, weight, bias)
    out = out.view(*x.shape[:-1], -1)
    return out if bias is None else out + bias


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


def pack_model_weights(model: nn.Module) -> int:
    """Pack every float ``Linear`` weight of ``model`` (and its tied LM head) for steps of
    ``PACKED_MIN_ROWS`` rows or more (GGUF blocks, where a layer has them, take steps of up
    to ``MAX_ROWS``); int8 layers are left alone. Returns the number packed."""
    count = 0
    for module in model.modules():
        if isinstance(module, Linear) and not isinstance(module.quant, Int8Weight):
            module.packed = pack_weight(module.weight)
            count += 1
    if model.tie_word_embeddings and not isinstance(model.tied_lm_head_quant, Int8Weight):
        model.tied_lm_head_packed = pack_weight(model.embed_tokens.weight)
        count += 1
    return count


class Linear(nn.Linear):
    """``nn.Linear`` that computes from ``quant`` when it is set: small batches from GGUF
    blocks of its weight (``attach_gguf_weights``), or all from int8 rows that replace the
    weight (``int8.quantize_model``); see ``linear``."""

    quant: GGUFWeight | Int8Weight | None = None
    packed: torch.Tensor | None = None  # pack_weight(weight), see linear()

    def reset_parameters(self) -> None:
        """No random initialization: ``load_weights`` overwrites every weight (and raises
        for one left unset), ``load_format="dummy"`` fills them itself. Initializing
        SmolLM2's 120 Linears took ~1 s of start-up for values thrown away."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.quant, self.packed)


def use_gguf_kernels(quantization: str | None, model_path: pathlib.Path, device: str) -> bool:
    """Whether to attach GGUF blocks: for a .gguf model unless ``quantization`` is "none"
    or "int8", and only on CPU where the C++ kernels build. Any model dtype: the kernels
    take float32 rows, so bfloat16 steps convert their few rows (``linear``); a lone
    request then reads 4-bit weights in bfloat16 too, instead of 16-bit ones.

    Raises ValueError for a ``quantization`` not in (None, *QUANTIZATION_CHOICES), "gguf"
    for a model that is not a GGUF file, or "int8" on a device other than the CPU.
    """
    if quantization not in (None, *QUANTIZATION_CHOICES):
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)} or "
                         f"unset; got {quantization!r}")
    is_gguf = pathlib.Path(model_path).suffix.lower() == ".gguf"
    if quantization == "gguf" and not is_gguf:
        raise ValueError(f"quantization 'gguf' needs a .gguf model; got {str(model_path)!r}")
    if quantization == "int8" and device != "cpu":
        raise ValueError(f"quantization 'int8' runs on CPU only; got device {device!r}")
    if quantization in ("none", "int8") or not is_gguf:
        return False
    if device != "cpu":
        logger.info("GGUF kernels run on CPU only: %s uses dequantized weights", device)
        return False
    return cpu_ops_available()


def attach_gguf_weights(model: nn.Module,
                        blocks: Iterable[tuple[str, GGMLQuantizationType, torch.Tensor]]) -> int:
    """Give each ``Linear`` of ``model``, and its tied LM head, the GGUF blocks of its weight
    (``repack_blocks``).

    ``blocks`` holds (HF name, type, rows) as ``gguf_loader.iter_gguf_blocks`` yields them.
    A fused layer (qkv_proj, gate_up_proj) gets its checkpoint tensors' rows concatenated in
    ``model.checkpoint_names`` order, only if all are there with one type and the kernel
    takes their row count (a multiple of 16). Returns the number of weights attached.
    """
    found = {name.removeprefix("model.").removesuffix(".weight"): (qtype, rows)
             for name, qtype, rows in blocks}
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            module.quant = _concat_rows(found, model.checkpoint_names(name))
            count += module.quant is not None
    if model.tie_word_embeddings:
        model.tied_lm_head_quant = _concat_rows(found, ["embed_tokens"])
        count += model.tied_lm_head_quant is not None
    return count


def _concat_rows(found: dict[str, tuple[GGMLQuantizationType, torch.Tensor]],
                 names: list[str]) -> GGUFWeight | None:
    parts = [found.get(n) for n in names]
    if any(p is None for p in parts) or len({qtype for qtype, _ in parts}) != 1:
        return None
    qtype = parts[0][0]
    rows = torch.cat([rows for _, rows in parts])
    if rows.shape[0] % TILE_ROWS:
        return None
    return GGUFWeight(repack_blocks(rows, qtype), qtype)
