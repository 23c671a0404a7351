"""FP4 weights on CUDA: a Triton GEMM that decodes MXFP4 / NVFP4 blocks as it multiplies
(``--quantization mxfp4|nvfp4`` on a CUDA device; formats: ``fp4_formats.py``).

Each program computes a ``[BLOCK_M, BLOCK_N]`` tile of ``x @ W.T``: per step of
``BLOCK_K`` columns it loads the activations, the weight's packed codes and their block
scales, decodes the codes (E2M1: sign, 2 exponent bits, 1 mantissa bit) and scales (MXFP4:
E8M0, ``2^(e - 127)``; NVFP4: E4M3) arithmetically, and accumulates ``tl.dot`` in float32;
NVFP4's tensor scale multiplies the result. The decoded weights are exact in the
activations' dtype (bfloat16 holds any E2M1 value times an E8M0 or E4M3 scale in its
normal range), so the product is the dequantized weight's, rounded as ``tl.dot`` rounds.
On CPU the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``), which is how
the tests check it against the dequantized reference; there its products are float32
whatever the activations' dtype (triton 3.9's interpreter returns garbage for a bfloat16
``tl.dot``), so a half-precision ``tl.dot`` runs on CUDA only.

Layout (this kernel's own, not the CPU tiles): ``codes`` uint8 ``[N, K / 2]``, element
``2j`` in the low nibble of byte ``j`` and ``2j + 1`` in the high one; ``scales`` uint8
``[N, K / block]`` (the E8M0 or E4M3 bytes; block 32 or 16).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.attention.triton_attn import INTERPRET
from pagedserve.quantization.base import Linear
from pagedserve.quantization.fp4_formats import (
    MXFP4_BLOCK,
    MXFP4_BLOCK_BYTES,
    NVFP4_BLOCK,
    quantize_mxfp4,
    quantize_nvfp4,
)

BLOCK_K = 32


@triton.jit
def _e2m1(codes):
    """E2M1 codes (int32) -> float32: ``(-1)^s * 2^(e - 1) * (1 + m / 2)``, subnormal
    ``m / 2`` at e = 0."""
    e = (codes >> 1) & 3
    m = (codes & 1).to(tl.float32)
    magnitude = tl.where(e == 0, m * 0.5, (1.0 + m * 0.5) * tl.exp2((e - 1).to(tl.float32)))
    return tl.where((codes & 8) != 0, -magnitude, magnitude)


@triton.jit
def _e4m3(bits):
    """FP8 E4M3 bytes (int32; not NaN) -> float32: ``2^(e - 7) * (1 + m / 8)``, subnormal
    ``2^-6 * m / 8`` at e = 0."""
    e = (bits >> 3) & 15
    m = (bits & 7).to(tl.float32)
    magnitude = tl.where(e == 0, m * 0.001953125,
                         (1.0 + m * 0.125) * tl.exp2((e - 7).to(tl.float32)))
    return tl.where((bits & 128) != 0, -magnitude, magnitude)


@triton.jit
def _fp4_matmul(x_ptr, codes_ptr, scales_ptr, out_ptr, M, N, K, stride_xm, stride_om,
                tensor_scale, SCALE_BLOCK: tl.constexpr, E8M0: tl.constexpr,
                DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # K is a multiple of BLOCK_K
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None], other=0.0)
        rb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        packed = tl.load(codes_ptr + rn[:, None] * (K // 2) + rb[None, :], mask=n_ok[:, None],
                         other=0).to(tl.int32)
        codes = tl.reshape(tl.join(packed & 15, packed >> 4), (BLOCK_N, BLOCK_K))
        s = tl.load(scales_ptr + rn[:, None] * (K // SCALE_BLOCK) + (rk // SCALE_BLOCK)[None, :],
                    mask=n_ok[:, None], other=0).to(tl.int32)
        if E8M0:
            scale = tl.exp2((s - 127).to(tl.float32))
        else:
            scale = _e4m3(s)
        w = _e2m1(codes) * scale
        if DOT_FP32:  # float32 products, not rounded to TF32
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    out = acc * tensor_scale
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], out.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@dataclass(frozen=True)
class TritonFP4Weight:
    """A weight ``[N, K]`` in FP4 for the Triton kernel: ``qweight`` the packed codes uint8
    ``[N, K / 2]``, ``scales`` uint8 ``[N, K / block]``, ``tensor_scale`` (NVFP4's; 1 for
    MXFP4)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    tensor_scale: float
    mxfp4: bool

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        out = fp4_matmul(x.reshape(-1, x.shape[-1]), self).view(*x.shape[:-1], -1)
        return out if layer.bias is None else out + layer.bias

    def fused_kernel(self, layer: Linear) -> None:
        return None  # the fused C++ decode step is CPU's


def fp4_matmul(x: torch.Tensor, weight: TritonFP4Weight) -> torch.Tensor:
    """``x [M, K] @ W.T -> [M, N]`` in x's dtype, W decoded from its FP4 blocks. Raises
    ValueError when K does not match the weight's."""
    n, half_k = weight.qweight.shape
    m, k = x.shape
    if k != 2 * half_k:
        raise ValueError(f"x has {k} columns; the FP4 weight has {2 * half_k}")
    x = x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, 64))
    _fp4_matmul[grid](x, weight.qweight, weight.scales, out, m, n, k, x.stride(0),
                      out.stride(0), weight.tensor_scale,
                      SCALE_BLOCK=MXFP4_BLOCK if weight.mxfp4 else NVFP4_BLOCK,
                      E8M0=weight.mxfp4, DOT_FP32=x.dtype == torch.float32 or INTERPRET,
                      BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=BLOCK_K)
    return out


def _pack_pairs(codes: torch.Tensor) -> torch.Tensor:
    """Codes ``[N, K]`` -> bytes ``[N, K / 2]``, element 2j low, 2j + 1 high."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def triton_mxfp4_weight(weight: torch.Tensor) -> TritonFP4Weight:
    """``weight [N, K]`` (K a multiple of 32) quantized to MXFP4 (``quantize_mxfp4``, on
    CPU), on the weight's device."""
    n = weight.shape[0]
    blocks = quantize_mxfp4(weight.detach().cpu()).view(n, -1, MXFP4_BLOCK_BYTES)
    qs = blocks[..., 1:]
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(n, -1)  # ggml's nibble order
    return TritonFP4Weight(_pack_pairs(codes).to(weight.device),
                           blocks[..., 0].contiguous().to(weight.device), 1.0, True)


def triton_nvfp4_weight(weight: torch.Tensor) -> TritonFP4Weight:
    """``weight [N, K]`` (K a multiple of 16) quantized to NVFP4 (``quantize_nvfp4``, on
    CPU), on the weight's device."""
    codes, scales, tensor_scale = quantize_nvfp4(weight.detach().cpu())
    return TritonFP4Weight(_pack_pairs(codes).to(weight.device),
                           scales.view(torch.uint8).contiguous().to(weight.device),
                           float(tensor_scale), False)
