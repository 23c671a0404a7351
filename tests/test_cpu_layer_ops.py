"""The C++ layer ops (``csrc/layer_ops_cpu.cpp``) against the PyTorch versions they replace."""

import pytest
import torch
import torch.nn.functional as F

from pagedserve.attention.torch_attn import write_kv_slots
from pagedserve.cpu_ops import load_cpu_ops
from pagedserve.models.layers import RMSNorm, RotaryEmbedding, silu_and_mul

OPS = load_cpu_ops()
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-6}, torch.bfloat16: {"rtol": 1e-2, "atol": 1e-2}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 576), (37, 64), (5, 3, 128)])
def test_rms_norm(dtype, shape):
    norm = RMSNorm(shape[-1], 1e-5).to(dtype)
    norm.weight.data = torch.randn(shape[-1], dtype=dtype)
    x = torch.randn(*shape, dtype=dtype) * 3
    out = norm(x)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out, norm.forward_native(x), **TOL[dtype])


def test_rms_norm_strided_rows():
    """Rows of a wider tensor (a column slice), as q/k views of the fused qkv output."""
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.randn(64)
    wide = torch.randn(9, 200)
    x = wide[:, 10:74]
    torch.testing.assert_close(norm(x), norm.forward_native(x), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 37])
def test_fused_add_rms_norm_equals_add_then_norm(dtype, tokens):
    """The residual add rounded to the dtype, then the norm: the bits of PyTorch's add and
    then the rms_norm op, as the Python decoder layer runs them (the norm itself is checked
    against forward_native above)."""
    norm = RMSNorm(576, 1e-5).to(dtype)
    norm.weight.data = torch.randn(576, dtype=dtype)
    hidden = torch.randn(tokens, 576, dtype=dtype) * 3
    delta = torch.randn(tokens, 576, dtype=dtype)
    expected_hidden = hidden + delta
    out = torch.empty_like(hidden)
    OPS.fused_add_rms_norm(out, hidden, delta, norm.weight, 1e-5)
    assert torch.equal(hidden, expected_hidden)
    expected = torch.empty_like(hidden)
    OPS.rms_norm(expected, expected_hidden, norm.weight, 1e-5)
    assert torch.equal(out, expected)
    torch.testing.assert_close(out, norm.forward_native(expected_hidden), **TOL[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary_dim,interleaved", [(64, False), (64, True), (32, True), (32, False)])
def test_rotary_in_place_matches_native(dtype, rotary_dim, interleaved):
    heads, kv_heads, head_dim, tokens = 9, 3, 64, 23
    rotary = RotaryEmbedding(head_dim, rotary_dim, 4096, 10000.0, None, interleaved).to(dtype)
    # q and k as views into one fused projection output, as in the model
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, 4096, (tokens,))
    q_ref, k_ref = rotary.forward_native(positions, q.clone(), k.clone())
    q_out, k_out = rotary(positions, q, k)
    assert q_out.data_ptr() == q.data_ptr()  # in place
    # bit-equal: the same roundings op by op (no fused multiply-add)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)


def test_reshape_and_cache_matches_index_copy_and_skips_negative_slots():
    num_blocks, block_size, kv_heads, head_dim, tokens = 6, 4, 3, 8, 7
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim)
    fused = torch.randn(tokens, 3 * kv_heads * head_dim)  # strided rows, as in the model
    key = fused[:, : kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    value = fused[:, kv_heads * head_dim : 2 * kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size)[:tokens]
    expected = cache.clone()
    write_kv_slots(key, value, expected, slots)
    OPS.reshape_and_cache(key, value, cache, slots)
    assert torch.equal(cache, expected)
    before = cache.clone()
    OPS.reshape_and_cache(key, value, cache, torch.full((tokens,), -1))
    assert torch.equal(cache, before)


def test_reshape_and_cache_rounds_into_a_bfloat16_cache():
    """--kv-cache-dtype bfloat16 under a float32 model: rows rounded as Tensor.to rounds."""
    num_blocks, block_size, kv_heads, head_dim, tokens = 5, 4, 2, 16, 9
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=torch.bfloat16)
    fused = torch.randn(tokens, 2 * kv_heads * head_dim) * 10
    key = fused[:, : kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    value = fused[:, kv_heads * head_dim :].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size)[:tokens]
    OPS.reshape_and_cache(key, value, cache, slots)
    k_rows = cache[0].view(-1, kv_heads, head_dim)[slots]
    v_rows = cache[1].view(-1, kv_heads, head_dim)[slots]
    assert torch.equal(k_rows, key.to(torch.bfloat16))
    assert torch.equal(v_rows, value.to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="dtype"):
        OPS.reshape_and_cache(key, value, cache.half(), slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,inter", [(1, 1536), (35, 1536), (64, 8192), (3, 100), (7, 37)])
def test_silu_and_mul_has_the_bits_of_silu_times_up(dtype, tokens, inter):
    """Bit for bit F.silu(gate) * up, the vectorized part (SLEEF's exp, a true division)
    and the elements PyTorch leaves to its scalar loop (inter not a multiple of 64); NaN
    where it is NaN (its vectorized bfloat16 NaN is 0xFFFF, c10's 0x7FC0)."""
    gen = torch.Generator().manual_seed(tokens * inter)
    gate_up = (torch.randn(tokens, 2 * inter, generator=gen) * 4).to(dtype)
    gate_up[0, :6] = torch.tensor([float("inf"), -float("inf"), float("nan"), -100.0, 100.0, 0.0])
    expected = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    out = silu_and_mul(gate_up)
    assert out.shape == (tokens, inter) and out.dtype == dtype
    nan = expected.isnan()
    assert torch.equal(out.isnan(), nan)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(out[~nan].view(bits), expected[~nan].view(bits))
