"""The Triton FP4 GEMM (``quantization/fp4_triton.py``) against the dequantized reference:
on CPU under Triton's interpreter (``TRITON_INTERPRET=1``, set in conftest.py when there is
no GPU), on CUDA where there is one."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pagedserve.attention import triton_attn
from pagedserve.quantization import QUANTIZATION_METHODS
from pagedserve.quantization.base import Linear, LoadContext
from pagedserve.quantization.fp4_formats import (
    dequantize_e2m1,
    dequantize_mxfp4,
    dequantize_nvfp4,
    quantize_mxfp4,
    quantize_nvfp4,
)
from pagedserve.quantization.fp4_triton import (
    TritonFP4Weight,
    fp4_matmul,
    triton_mxfp4_weight,
    triton_nvfp4_weight,
)

CUDA = torch.cuda.is_available()
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(
        not triton_attn.INTERPRET,
        reason="kernels compiled for CUDA; CPU needs TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="needs a CUDA device")),
]


def reference(fmt: str, w: torch.Tensor) -> torch.Tensor:
    """The weight as the format dequantizes it (float32)."""
    if fmt == "mxfp4":
        return dequantize_mxfp4(quantize_mxfp4(w))
    return dequantize_nvfp4(*quantize_nvfp4(w))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("m, n, k", [(1, 64, 64), (5, 48, 96), (20, 80, 160)])
def test_fp4_matmul_matches_the_dequantized_weight(device, fmt, m, n, k):
    gen = torch.Generator().manual_seed(m * n + k)
    w = torch.randn(n, k, generator=gen) * 0.05
    w[0, :32] *= 40  # a block of large weights: its own scale
    x = torch.randn(m, k, generator=gen)
    make = triton_mxfp4_weight if fmt == "mxfp4" else triton_nvfp4_weight
    weight = make(w.to(device))
    out = fp4_matmul(x.to(device), weight).cpu()
    expected = x.double() @ reference(fmt, w).double().T
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_fp4_matmul_in_bfloat16_decodes_exactly(device):
    """bfloat16 activations: the decoded weights are exact in bfloat16 (MXFP4 and NVFP4
    values alike), so the product is the bfloat16 activations times the dequantized
    weight, summed in float32, then rounded to bfloat16."""
    gen = torch.Generator().manual_seed(7)
    w, x = torch.randn(32, 64, generator=gen) * 0.05, torch.randn(3, 64, generator=gen)
    for make, fmt in ((triton_mxfp4_weight, "mxfp4"), (triton_nvfp4_weight, "nvfp4")):
        deq = reference(fmt, w)
        if fmt == "mxfp4":
            decoded = deq  # E2M1 values times powers of two
        else:  # E2M1 values times E4M3 block scales, before the tensor scale
            codes, scales, _ = quantize_nvfp4(w)
            decoded = dequantize_e2m1(codes) * scales.float().repeat_interleave(16, dim=1)
        assert torch.equal(decoded.bfloat16().float(), decoded)
        out = fp4_matmul(x.bfloat16().to(device), make(w.to(device))).cpu()
        assert out.dtype == torch.bfloat16
        expected = x.bfloat16().double() @ deq.double().T
        torch.testing.assert_close(out.double(), expected, rtol=8e-3, atol=1e-3)


def test_fp4_matmul_rejects_a_mismatched_width():
    weight = triton_mxfp4_weight(torch.randn(16, 64))
    with pytest.raises(ValueError, match="x has 32 columns; the FP4 weight has 64"):
        fp4_matmul(torch.randn(2, 32), weight)


@pytest.mark.skipif(not (triton_attn.INTERPRET or CUDA), reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("name", ["mxfp4", "nvfp4"])
def test_method_gives_cuda_layers_triton_weights(name, tmp_path):
    """``--quantization mxfp4|nvfp4`` off CPU: every Linear the kernel takes holds a
    ``TritonFP4Weight`` (its codes as the weight parameter) and computes the dequantized
    product; one it cannot take stays in float. (The device is named cuda; under the
    interpreter the tensors stay on CPU.)"""
    device = "cuda" if CUDA else "cpu"
    gen = torch.Generator().manual_seed(1)
    model = torch.nn.Module()
    model.a, model.b = Linear(64, 48, bias=False), Linear(30, 40, bias=False)
    for layer in (model.a, model.b):
        layer.weight.data = (torch.randn(layer.weight.shape, generator=gen) * 0.05).to(device)
    float_a = model.a.weight.detach().cpu().clone()
    ctx = LoadContext(tmp_path / "model.gguf", "cuda", torch.float32, 64, lambda: None, None)
    method = QUANTIZATION_METHODS[name]()
    assert method.process_model(model, ctx) == (
        f"{name} weights: 0 from the file, 1 quantized at load, 1 kept in float")
    assert isinstance(model.a.method, TritonFP4Weight) and model.a.weight.dtype == torch.uint8
    assert not isinstance(model.b.method, TritonFP4Weight)
    x = torch.randn(3, 64, generator=gen)
    expected = x.double() @ reference(name, float_a).double().T
    torch.testing.assert_close(model.a(x.to(device)).cpu().double(), expected, rtol=1e-5,
                               atol=1e-5)
