"""The 4-bit floating formats MXFP4 and NVFP4: quantize, dequantize, and the bytes the CPU
block kernel (``ggml_mul_mat_a8``, ``csrc/gguf_gemm_cpu.cpp``) reads.

Both formats store E2M1 elements (1 sign bit, 2 exponent bits, 1 mantissa bit: magnitudes
0, 0.5, 1, 1.5, 2, 3, 4, 6) in blocks that share a scale:

- **MXFP4**, OCP Microscaling Formats (MX) Specification v1.0 (2023): blocks of 32, one
  E8M0 scale each (a power of two, 2^(e - 127)). Conversion, section 6.3:
  ``X = 2^(floor(log2(max|v|)) - emax_elem)`` with ``emax_elem = 2`` (E2M1's largest
  exponent), then each ``v / X`` rounded to the nearest E2M1 value, ties to even, and
  clamped to +-6 (the rule lets a block's largest element reach 8 > 6 before clamping).
  An all-zero block takes e = 0. Bytes as ggml's ``block_mxfp4`` (``ggml-common.h``):
  e, then 16 bytes whose low nibbles are elements 0..15 and high nibbles 16..31.
- **NVFP4**, NVIDIA (Blackwell's format; "Introducing NVFP4 for Efficient and Accurate
  Low-Precision Inference", 2025; TensorRT Model Optimizer's ``NVFP4QTensor``): blocks of
  16, one FP8 E4M3 scale each, and one float32 scale per tensor:
  ``global = max|W| / (448 * 6)``, ``s_b = E4M3(max|block| / (6 * global))`` (round to
  nearest even, at most 448), elements ``E2M1(v / (s_b * global))`` (ties to even, clamped
  to +-6); ``v = e2m1 * (s_b * global)``.

Quantizing (``quantize_mxfp4``, ``quantize_nvfp4``; C++, ``csrc/fp4_quant_cpu.cpp``) follows
these rules, and by default then searches each block's scale: among the rule's and its
neighbours (MXFP4: one power of two either side; NVFP4: four E4M3 codes either side) the one
of least squared error, the elements rounded to nearest for it. The bytes are the format's
all the same; on the bundled model the search lowers NVFP4's weight error from 9.5% to
8.1% and MXFP4's from 11.8% to 11.3% (``benchmarks/quant_accuracy.py``).

ggml's ``NVFP4`` GGUF type is another encoding of the same elements: blocks of 64 holding
four unsigned E4M3 sub-scales (``gguf.quants.NVFP4``), no tensor scale. It converts to
the kernel's layout value for value (``nvfp4_ggml_to_kernel``).

The kernel multiplies E2M1 elements doubled (the integers 0, +-1, +-2, +-3, +-4, +-6, +-8,
+-12; ggml's ``kvalues_mxfp4``) and halves the scales, so every product is an integer dot.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import NVFP4 as GGML_NVFP4

from pagedserve.cpu_ops import load_cpu_ops

MXFP4_BLOCK, NVFP4_BLOCK = 32, 16       # elements per scale
MXFP4_BLOCK_BYTES = 1 + MXFP4_BLOCK // 2  # E8M0 scale + 16 bytes of nibbles
E2M1_MAX, E4M3_MAX = 6.0, 448.0
# Element code (bit 3 the sign) -> value. Codes 0 and 8 are +0 and -0.
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                            -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])

# The kernel's block types (ggml_mul_mat_a8): MXFP4 is ggml's bytes repacked; NVFP4 rows
# are the kernel's own (``nvfp4_kernel_rows``).
MXFP4, NVFP4 = GGMLQuantizationType.MXFP4, GGMLQuantizationType.NVFP4
TILE_ROWS = 16


def kernel_tile_bytes(qtype: GGMLQuantizationType, k: int) -> int:
    """Bytes of one kernel tile (16 rows) of ``k`` columns of ``qtype`` (``gguf_gemm_cpu.cpp``:
    MXFP4, the blocks' 16-byte scales padded to 64 bytes, then 256 bytes of quants each;
    NVFP4, 320 bytes a block, then 64 bytes of row scales)."""
    blocks = k // 32
    if qtype == MXFP4:
        return -(-blocks * TILE_ROWS // 64) * 64 + blocks * 16 * TILE_ROWS
    return blocks * 20 * TILE_ROWS + 4 * TILE_ROWS


def dequantize_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8) -> float32 values."""
    return E2M1_VALUES[codes.long()]


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Codes ``[..., 32]`` -> bytes ``[..., 16]``: element j in the low nibble of byte j,
    element 16 + j in its high nibble (ggml's block_mxfp4 / block_q4_1 order)."""
    return codes[..., :16] | (codes[..., 16:] << 4)


def _unpack_nibbles(qs: torch.Tensor) -> torch.Tensor:
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def quantize_mxfp4(w: torch.Tensor, search: bool = True) -> torch.Tensor:
    """``w [N, K]`` (K a multiple of 32) -> MXFP4 blocks uint8 ``[N, K / 32 * 17]`` in
    ggml's byte order, by the OCP MX v1.0 rule and (``search``) each block's scale of least
    squared error (module docstring). Raises ValueError for another K or NaN weights."""
    _check(w, MXFP4_BLOCK, "MXFP4")
    return load_cpu_ops().quantize_mxfp4(w.detach().float().contiguous(), search)


def _check(w: torch.Tensor, block: int, name: str) -> None:
    if w.dim() != 2 or w.shape[1] % block:
        raise ValueError(f"{name} needs [N, K] weights with K a multiple of {block}; got "
                         f"{list(w.shape)}")
    if torch.isnan(w).any():
        raise ValueError(f"{name} quantization: the weight holds NaN")


def dequantize_mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    """MXFP4 blocks uint8 ``[N, K / 32 * 17]`` -> float32 ``[N, K]``: ``2^(e - 127) * v``
    (E8M0 255, NaN in the spec, is read as 2^128 -> inf here; ggml reads 2^127)."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, MXFP4_BLOCK_BYTES)
    scale = torch.pow(2.0, b[..., 0].double() - 127)
    values = dequantize_e2m1(_unpack_nibbles(b[..., 1:])).double()
    return (values * scale.unsqueeze(-1)).float().reshape(n, -1)


def quantize_nvfp4(w: torch.Tensor, search: bool = True
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w [N, K]`` (K a multiple of 16) -> (codes uint8 ``[N, K]``, block scales
    float8_e4m3fn ``[N, K / 16]``, tensor scale float32 ``[]``) by NVIDIA's rule and
    (``search``) each block's scale of least squared error (module docstring). Raises
    ValueError for another K or NaN weights."""
    _check(w, NVFP4_BLOCK, "NVFP4")
    w = w.detach().float().contiguous()
    amax = w.abs().amax()
    global_scale = amax / (E4M3_MAX * E2M1_MAX) if amax > 0 else torch.tensor(1.0)
    codes, scales = load_cpu_ops().quantize_nvfp4(w, float(global_scale), search)
    return codes, scales.view(torch.float8_e4m3fn), global_scale.float()


def dequantize_nvfp4(codes: torch.Tensor, scales: torch.Tensor,
                     global_scale: torch.Tensor) -> torch.Tensor:
    """``e2m1 * (s_b * global)``, float32 ``[N, K]``, from ``quantize_nvfp4``'s parts."""
    n, k = codes.shape
    step = (scales.float() * global_scale).unsqueeze(-1)
    return (dequantize_e2m1(codes).reshape(n, -1, NVFP4_BLOCK) * step).reshape(n, k)


def nvfp4_kernel_rows(codes: torch.Tensor, half_scales: torch.Tensor,
                      row_scales: torch.Tensor) -> torch.Tensor:
    """The NVFP4 weight ``w[n, k] = row_scales[n] * half_scales[n, k // 16] * 2 *
    e2m1(codes[n, k])`` as the kernel's type-40 tiles: uint8 ``[N / 16, K / 32 * 320 +
    64]``.

    codes uint8 ``[N, K]``; half_scales ``[N, K / 16]`` float32 values that fp16 holds
    exactly (an E4M3 scale halved always is); row_scales float32 ``[N]``. Per row and block
    of 32, the bytes are Q4_1's shape: fp16 scale of elements 0..15, fp16 scale of
    16..31, 16 bytes of nibbles (element j low, 16 + j high); repacked in tiles as Q4_1's
    (``gguf_gemm_cpu.cpp``), each tile followed by its 16 row scales. Raises ValueError
    when N is not a multiple of 16, K of 32, or a scale is not exact in fp16."""
    n, k = codes.shape
    if n % TILE_ROWS or k % MXFP4_BLOCK:
        raise ValueError(f"the NVFP4 kernel takes [N, K] with N a multiple of {TILE_ROWS} "
                         f"and K of {MXFP4_BLOCK}; got [{n}, {k}]")
    halves = half_scales.to(torch.float16)
    if not torch.equal(halves.float(), half_scales.float()):
        raise ValueError("NVFP4 block scales must be exact in fp16")
    blocks = k // MXFP4_BLOCK
    scale_bytes = halves.reshape(n, blocks, 2).view(torch.uint8)       # [N, blocks, 4]
    qs = _pack_nibbles(codes.reshape(n, blocks, MXFP4_BLOCK))        # [N, blocks, 16]
    rows = torch.cat([scale_bytes, qs], dim=-1).reshape(n, -1).contiguous()
    tiles = load_cpu_ops().repack_gguf_blocks(rows, int(GGMLQuantizationType.Q4_1))
    tail = row_scales.float().contiguous().view(torch.uint8).reshape(n // TILE_ROWS, -1)
    return torch.cat([tiles, tail], dim=1).contiguous()


def nvfp4_ggml_parts(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml NVFP4 rows uint8 ``[N, K / 64 * 36]`` (per block of 64: four unsigned E4M3
    sub-scales, then 32 bytes, sub-block s in bytes 8s..8s+7, element i < 8 in the low
    nibble of byte i and 8 + i in its high one) -> (codes uint8 ``[N, K]``, half_scales
    float32 ``[N, K / 16]``), the sub-scales by ggml's own decoder
    (``gguf.quants.NVFP4.ue4m3_to_fp32``, which halves them)."""
    n = rows.shape[0]
    b = rows.reshape(n, -1, 36)
    half_scales = torch.from_numpy(
        GGML_NVFP4.ue4m3_to_fp32(b[..., :4].numpy()).astype(np.float32)).reshape(n, -1)
    qs = b[..., 4:].reshape(n, -1, 4, 8)
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(n, -1)
    return codes, half_scales


def nvfp4_ggml_to_kernel(rows: torch.Tensor) -> torch.Tensor:
    """ggml NVFP4 rows (``nvfp4_ggml_parts``) -> the kernel's type-40 tiles, value for
    value (the tensor scale is 1)."""
    codes, half_scales = nvfp4_ggml_parts(rows)
    return nvfp4_kernel_rows(codes, half_scales, torch.ones(rows.shape[0]))
