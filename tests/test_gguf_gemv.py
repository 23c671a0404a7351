"""GGUF block kernels (torch.ops.pagedserve.ggml_mul_mat_a8: Q4_1, Q8_0, MXFP4, NVFP4) and their use by the
model: the kernel against an independent reference (activations rounded to 8 bits per block
of 32, times the weights dequantized by gguf-py), the blocks the loader keeps against the
dequantized weights, and the engine's accuracy against the exact float32 path."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from pagedserve import LLM, SamplingParams
from pagedserve.cpu_ops import cpu_ops_available, load_cpu_ops
from pagedserve.model_loader.gguf_file import iter_gguf_blocks, iter_gguf_weights
from pagedserve.quantization import get_quantization_method
from pagedserve.quantization import gguf as gguf_module
from pagedserve.quantization import none as none_module
from pagedserve.quantization.base import Linear
from pagedserve.quantization.fp4 import nvfp4_weight
from pagedserve.quantization.fp4_formats import dequantize_nvfp4, quantize_nvfp4
from pagedserve.quantization.gguf import KERNEL_TYPES, GGUFEmbedding, GGUFWeight, repack_blocks
from pagedserve.quantization.none import float_linear

pytestmark = pytest.mark.skipif(not cpu_ops_available(), reason="C++ CPU kernels unavailable")


def random_blocks(qtype: Q, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random GGUF blocks uint8 [n, k / block * type_size]: random fp16 scales (and Q4_1
    mins) of either sign, or FP4's E8M0 / unsigned E4M3 scales (every byte but NVFP4's
    0x7F..0xFF, which ggml never writes), random quants."""
    block, size = GGML_QUANT_SIZES[qtype]
    num = n * k // block
    if qtype == Q.MXFP4:  # E8M0 2^-11 .. 2^-4, then 16 bytes of codes
        scale = rng.integers(116, 124, (num, 1), dtype=np.uint8)
        return np.concatenate([scale, rng.integers(0, 256, (num, 16), dtype=np.uint8)],
                              axis=1).reshape(n, -1)
    if qtype == Q.NVFP4:  # four unsigned E4M3 sub-scales, then 32 bytes of codes
        scales = rng.integers(0, 0x7F, (num, 4), dtype=np.uint8)
        return np.concatenate([scales, rng.integers(0, 256, (num, 32), dtype=np.uint8)],
                              axis=1).reshape(n, -1)
    scale = rng.uniform(-0.05, 0.05, (num, 1)).astype(np.float16).view(np.uint8)
    parts = [scale]
    if qtype == Q.Q4_1:
        parts.append(rng.uniform(-0.5, 0.5, (num, 1)).astype(np.float16).view(np.uint8))
    parts.append(rng.integers(0, 256, (num, size - 2 * len(parts)), dtype=np.uint8))
    return np.concatenate(parts, axis=1).reshape(n, k // block * size)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def a8_round(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] with each block of 32 rounded to 8 bits (d = max|x| / 127, q =
    round_half_even(x * (1 / d)), all in float32, as llama.cpp's block_q8_1 with float
    scales): q * d."""
    blocks = x.float().reshape(*x.shape[:-1], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / torch.where(d > 0, d, 1), 0)
    return (torch.round(blocks * inv) * d).reshape(x.shape)


def a8_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``a8_round(x) [M, K]`` times weight [N, K]^T, in float64."""
    return F.linear(a8_round(x).double(), weight.double())


def kernel(blocks: np.ndarray, x: torch.Tensor, qtype: Q) -> torch.Tensor:
    return load_cpu_ops().ggml_mul_mat_a8(repack_blocks(torch.from_numpy(blocks), qtype), x,
                                          int(qtype))


@pytest.mark.parametrize("qtype", KERNEL_TYPES)
@pytest.mark.parametrize("n, k", [(16, 64), (48, 128), (208, 576), (64, 1536), (32, 320)])
def test_kernel_matches_8bit_activation_reference(qtype, n, k):
    """One to many tiles of 16 rows and blocks of 32 (64: ggml's NVFP4 block), every row
    count of a pass (1-8) and several passes (up to 64 rows: a decode step); a row of zeros
    too. FP4: the weights as gguf-py dequantizes ggml's blocks."""
    rng = np.random.default_rng(n * k)
    blocks = random_blocks(qtype, n, k, rng)
    weight = torch.from_numpy(dequantize(blocks, qtype).copy())  # gguf-py
    for m in (1, 2, 3, 5, 8, 9, 16, 19, 64):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        if m > 1:
            x[m // 2] = 0
        out = kernel(blocks, x, qtype)
        assert out.shape == (m, n) and out.dtype == torch.float32
        if m > 1:
            assert torch.equal(out[m // 2], torch.zeros(n))
        # the integer sums are exact: float32 summation-order rounding only
        assert rel_err(out, a8_reference(x, weight)) < 2e-6
        # and x's rounding moves each output by at most sum |w| * (half a step of x's block)
        half_step = (x.reshape(m, -1, 32).abs().amax(-1, keepdim=True) / 254).expand(-1, -1, 32)
        bound = F.linear(half_step.reshape(m, k).double(), weight.double().abs())
        assert ((out - F.linear(x.double(), weight.double())).abs() <= bound * 1.001 + 1e-6).all()
        # each row's result is the same whatever else is in the step: alone it takes the
        # vector kernel, in 16 rows or more AMX tiles where the CPU has them
        alone = torch.cat([kernel(blocks, x[i:i + 1], qtype) for i in range(m)])
        assert torch.equal(out, alone)


@pytest.mark.parametrize("qtype", KERNEL_TYPES)
def test_kernel_reads_and_writes_bfloat16(qtype):
    """A bfloat16 x gives its float32 product rounded to bfloat16 (nearest even), bit for
    bit, in one call; and ties of x's rounding go to even (a block with max|x| = 127 has
    d = 1, so x = k + 0.5 is a tie)."""
    blocks = random_blocks(qtype, 48, 128, np.random.default_rng(7))
    weight = torch.from_numpy(dequantize(blocks, qtype).copy())
    x = torch.randn(19, 128, generator=torch.Generator().manual_seed(7)).bfloat16()
    x[3, :32] = torch.tensor([127] + [k + 0.5 for k in range(-15, 16)])
    out = kernel(blocks, x, qtype)
    assert out.dtype == torch.bfloat16 and out.shape == (19, 48)
    exact = kernel(blocks, x.float(), qtype)
    assert torch.equal(out, exact.bfloat16())
    assert rel_err(exact, a8_reference(x, weight)) < 2e-6


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0, Q.MXFP4])
def test_repacked_blocks_hold_the_same_bytes_per_tile(qtype):
    """32 rows of 2 blocks: two tiles of 16 rows; per tile and block the 16 scales, (Q4_1)
    the 16 mins, then chunks of each row's next 4 quant bytes; MXFP4's tiles hold their
    blocks' scales first. (NVFP4 tiles: test_fp4.)"""
    size = GGML_QUANT_SIZES[qtype][1]
    scale_fields = {Q.Q4_1: [(0, 2), (2, 4)], Q.Q8_0: [(0, 2)], Q.MXFP4: [(0, 1)]}[qtype]
    quants_start = scale_fields[-1][1]
    rows = torch.arange(32 * 2 * size, dtype=torch.int32).remainder(251).to(torch.uint8)
    rows = rows.view(32, 2 * size)
    packed = repack_blocks(rows, qtype)
    blocks = rows.view(2, 16, 2, size)  # [tile, row, block, bytes]
    for t in range(2):
        scales = [[blocks[t, :, b, i:j].reshape(-1) for i, j in scale_fields] for b in range(2)]
        quants = [[blocks[t, :, b, c : c + 4].reshape(-1) for c in range(quants_start, size, 4)]
                  for b in range(2)]
        if qtype == Q.MXFP4:  # every block's scales first, padded to 64 bytes, then quants
            expected = scales[0] + scales[1] + [torch.zeros(32, dtype=torch.uint8)]
            expected += quants[0] + quants[1]
        else:  # block after block
            expected = scales[0] + quants[0] + scales[1] + quants[1]
        assert torch.equal(packed[t], torch.cat(expected))
    stored = gguf_module._concat_rows({"w": ("w.weight", qtype, rows[:16])}, ("w",))
    assert stored.names == ("w.weight",) and torch.equal(stored.qweight, packed[:1])
    assert gguf_module._concat_rows({"w": ("w.weight", qtype, rows[:24])}, ("w",)) is None


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0])  # FP4 types: gguf-py's own, test_fp4
def test_dequantization_is_bit_equal_to_gguf_py(qtype):
    blocks = random_blocks(qtype, 37, 96, np.random.default_rng(int(qtype)))
    ours = load_cpu_ops().dequantize_gguf_blocks(torch.from_numpy(blocks), int(qtype))
    assert torch.equal(ours, torch.from_numpy(dequantize(blocks, qtype).copy()))


@pytest.mark.parametrize("qtype", KERNEL_TYPES)
def test_rows_from_tiles_dequantize_as_gguf_py(qtype):
    """An embedding's lookup from repacked tiles (``ggml_get_rows``): each id's row, bit-equal
    to gguf-py's dequantization of the file's blocks (ggml's NVFP4 converted to the kernel's
    rows, value for value)."""
    rng = np.random.default_rng(int(qtype))
    blocks = random_blocks(qtype, 48, 128, rng)
    ids = torch.tensor([0, 47, 16, 16, 5, 31, 32])
    rows = load_cpu_ops().ggml_get_rows(repack_blocks(torch.from_numpy(blocks), qtype), ids,
                                        int(qtype))
    expected = torch.from_numpy(dequantize(blocks, qtype))[ids]
    torch.testing.assert_close(rows, expected, rtol=0, atol=0)


def test_rows_from_nvfp4_tiles_apply_the_row_scale():
    """NVFP4 kernel rows with a tensor scale: ``r * (s * v)``, within one rounding of the
    format's dequantization ``v * (s * r)``."""
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(3)) * 0.03
    codes, scales, global_scale = quantize_nvfp4(w)
    rows = load_cpu_ops().ggml_get_rows(nvfp4_weight(w).qweight, torch.arange(32), int(Q.NVFP4))
    torch.testing.assert_close(rows, dequantize_nvfp4(codes, scales, global_scale),
                               rtol=2.4e-7, atol=0)


def test_block_conversions_reject_bad_inputs():
    ops, rows = load_cpu_ops(), torch.zeros(16, 40, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="type must be 3"):
        ops.dequantize_gguf_blocks(rows, int(Q.Q4_0))
    with pytest.raises(RuntimeError, match="whole blocks of 34"):
        ops.dequantize_gguf_blocks(rows, int(Q.Q8_0))
    with pytest.raises(RuntimeError, match="uint8"):
        ops.repack_gguf_blocks(rows.float(), int(Q.Q4_1))
    with pytest.raises(RuntimeError, match="whole tiles of 16"):
        ops.repack_gguf_blocks(rows[:8], int(Q.Q4_1))
    tiles = ops.repack_gguf_blocks(torch.zeros(16, 20, dtype=torch.uint8), int(Q.Q4_1))
    with pytest.raises(RuntimeError, match=r"id 16 is not in \[0, 16\)"):
        ops.ggml_get_rows(tiles, torch.tensor([3, 16]), int(Q.Q4_1))


def test_kernel_rejects_bad_inputs():
    ops = load_cpu_ops()
    blocks = repack_blocks(torch.from_numpy(random_blocks(Q.Q8_0, 16, 64, np.random.default_rng(0))),
                           Q.Q8_0)
    with pytest.raises(RuntimeError, match="qweight_type"):
        ops.ggml_mul_mat_a8(blocks, torch.randn(1, 64), int(Q.Q4_0))
    with pytest.raises(RuntimeError, match="columns"):
        ops.ggml_mul_mat_a8(blocks, torch.randn(1, 96), int(Q.Q8_0))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.ggml_mul_mat_a8(blocks, torch.randn(1, 48), int(Q.Q8_0))
    with pytest.raises(RuntimeError, match="float32"):
        ops.ggml_mul_mat_a8(blocks, torch.randn(1, 64, dtype=torch.float64), int(Q.Q8_0))


def test_linear_uses_blocks_for_every_step():
    """With a float weight of zeros, every row, prefill-sized steps too, is computed from the
    blocks (rows of ones round to 8 bits exactly)."""
    rng = np.random.default_rng(1)
    blocks = random_blocks(Q.Q4_1, 48, 64, rng)
    quant = GGUFWeight(repack_blocks(torch.from_numpy(blocks), Q.Q4_1), Q.Q4_1)
    layer = Linear(64, 48, bias=True)
    torch.nn.init.zeros_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    layer.method = quant
    expected = F.linear(torch.ones(1, 64), torch.from_numpy(dequantize(blocks, Q.Q4_1).copy()))
    for rows in (1, 64, 65, 300):
        with torch.no_grad():
            out = layer(torch.ones(rows, 64))
        torch.testing.assert_close(out, (expected + layer.bias).expand(rows, -1))
    with torch.no_grad():
        assert layer(torch.ones(2, 3, 64)).shape == (2, 3, 48)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_from_blocks_in_half_precision(dtype):
    """bfloat16 / float16 rows (a half-precision model's small steps) are multiplied by the
    blocks in float32 and come back in their own dtype, within that dtype's rounding of the
    reference product."""
    rng = np.random.default_rng(2)
    blocks = random_blocks(Q.Q4_1, 48, 128, rng)
    quant = GGUFWeight(repack_blocks(torch.from_numpy(blocks), Q.Q4_1), Q.Q4_1)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(2)).to(dtype)
    layer = Linear(128, 48, bias=False, dtype=dtype)
    torch.nn.init.zeros_(layer.weight)
    with torch.no_grad():
        out = quant.apply(layer, x)
    reference = a8_reference(x, torch.from_numpy(dequantize(blocks, Q.Q4_1).copy()))
    assert out.dtype == dtype and out.shape == (5, 48)
    assert rel_err(out, reference) < torch.finfo(dtype).eps


def test_packed_weights_serve_steps_without_autograd_only():
    """The packed weight serves inference steps (leading dimensions kept, bias added, close
    to the float64 product); with autograd on, F.linear runs and gradients flow."""
    gen = torch.Generator().manual_seed(5)
    weight, bias = torch.randn(300, 96, generator=gen), torch.randn(300, generator=gen)
    x3 = torch.randn(2, 20, 96, generator=gen)
    exact = F.linear(x3.double(), weight.double(), bias.double()).float()
    zeros = none_module.pack_weight(torch.zeros_like(weight))  # shows which path ran
    with torch.no_grad():
        torch.testing.assert_close(float_linear(x3, weight, bias, none_module.pack_weight(weight)),
                                   exact)
        assert torch.equal(float_linear(x3, weight, bias, zeros), bias.expand(2, 20, -1))
    weight.requires_grad_(True)
    float_linear(x3, weight, None, zeros).sum().backward()
    torch.testing.assert_close(weight.grad, x3.reshape(40, 96).sum(0).expand(300, -1))


def test_model_float_weights_are_packed(llm, llm_gguf):
    """The exact engine packs every float weight (float32 and bfloat16 pack; CUDA does not);
    the GGUF engine keeps blocks alone, no float path."""
    assert none_module.packing_available("cpu", torch.float32)
    assert none_module.packing_available("cpu", torch.bfloat16)
    assert not none_module.packing_available("cpu", torch.float16)
    assert not none_module.packing_available("cuda", torch.float32)
    exact = llm.engine.executor.driver_worker.model
    layers = [m for m in exact.modules() if isinstance(m, Linear)]
    assert exact.lm_head in layers and all(m.method.packed is not None for m in layers)
    gguf = llm_gguf.engine.executor.driver_worker.model
    assert all(isinstance(m.method, GGUFWeight) for m in gguf.modules() if isinstance(m, Linear))


def test_quantization_method_choices(model_path, tmp_path):
    """The registry's default is GGUF blocks for a GGUF model on CPU with one rank."""
    def method(*args):
        return get_quantization_method(*args).name

    assert method(None, model_path, "cpu") == "gguf"
    assert method("gguf", model_path, "cpu") == "gguf"
    assert method("none", model_path, "cpu") == "none"
    assert method(None, model_path, "cuda") == "none"
    assert method(None, model_path, "cpu", 3) == "none"  # tensor parallel: dequantized
    assert method(None, tmp_path, "cpu") == "none"
    with pytest.raises(ValueError, match="must be one of gguf, int8, mxfp4, none, nvfp4"):
        get_quantization_method("awq", model_path, "cpu")
    with pytest.raises(ValueError, match="needs a .gguf model"):
        get_quantization_method("gguf", tmp_path, "cpu")


def test_loader_blocks_dequantize_to_loaded_weights(model_path):
    """Blocks in HF row order (q/k un-permuted) dequantize to the weights iter_gguf_weights
    yields."""
    wanted = {"model.embed_tokens.weight"} | {
        f"model.layers.1.{m}.weight" for m in ("self_attn.q_proj", "self_attn.k_proj",
                                               "self_attn.v_proj", "mlp.down_proj")}
    blocks = {name: (qtype, rows) for name, qtype, rows in iter_gguf_blocks(model_path,
                                                                            KERNEL_TYPES)}
    assert len(blocks) == 30 * 7 + 1  # every linear weight (Q4_1) and token_embd (Q8_0)
    assert blocks["model.embed_tokens.weight"][0] == Q.Q8_0
    for name, weight in iter_gguf_weights(model_path, torch.float32):
        if name in wanted:
            qtype, rows = blocks[name]
            torch.testing.assert_close(torch.from_numpy(dequantize(rows.numpy(), qtype)), weight,
                                       rtol=0, atol=0)


@pytest.fixture(scope="module")
def llm_gguf():
    """The default engine on the bundled model in float32: GGUF block kernels for every
    step."""
    return LLM(dtype="float32", max_model_len=1024, kv_cache_memory_bytes=256 << 20)


def test_model_layers_carry_their_blocks(llm_gguf, model_path):
    """Every Linear (fused q/k/v and gate/up included) and the tied head computes, from its
    blocks, the reference product with the file's dequantized weights; the embedding looks
    its rows up in the same blocks, bit-equal to the float table; no float copy is kept."""
    model = llm_gguf.engine.executor.driver_worker.model
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(layers) == 4 * 30 + 1 and layers[-1] is model.lm_head
    assert all(isinstance(m.method, GGUFWeight) for m in layers)
    assert isinstance(model.embed_tokens, GGUFEmbedding)
    assert model.lm_head.weight is model.embed_tokens.weight  # tied: blocks of the embedding
    floats = sum(p.numel() for p in model.parameters() if p.is_floating_point())
    assert floats == 576 * (2 * 30 + 1)  # the norms only
    blocks = sum(p.numel() for p in model.parameters() if not p.is_floating_point())
    assert blocks == 66_355_200 + 30_081_024  # the file's Q4_1 and Q8_0 bytes
    wanted = {name for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                             "self_attn.o_proj", "mlp.down_proj", "embed_tokens")
              for name in (f"model.layers.0.{m}.weight", f"model.{m}.weight")}
    weights = {n: w for n, w in iter_gguf_weights(model_path, torch.float32) if n in wanted}
    table = weights["model.embed_tokens.weight"]
    attn = model.layers[0].self_attn
    heads = [(attn.qkv_proj, torch.cat([weights[f"model.layers.0.self_attn.{p}_proj.weight"]
                                        for p in "qkv"])),
             (attn.o_proj, weights["model.layers.0.self_attn.o_proj.weight"]),
             (model.layers[0].mlp.down_proj, weights["model.layers.0.mlp.down_proj.weight"]),
             (model.lm_head, table)]
    for layer, weight in heads:
        x = torch.randn(3, weight.shape[1])
        assert rel_err(layer(x), a8_reference(x, weight)) < 1e-5
    ids = torch.tensor([[0, 1, 49151], [7, 7, 30000]])
    assert torch.equal(model.embed_tokens(ids), table[ids])


def teacher_forced(exact_llm: LLM, llm: LLM, prompts: list[list[int]]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact engine's 32 greedy tokens after each prompt, and the logprob of each of
    them (prompt positions after the first too) as ``exact_llm`` and ``llm`` score them."""
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    ref = exact_llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    seqs = [p + o.outputs[0].token_ids for p, o in zip(prompts, ref)]
    score = SamplingParams(max_tokens=1, prompt_logprobs=0)

    def logprobs(engine):
        outs = engine.generate([{"prompt_token_ids": s} for s in seqs], score, use_tqdm=False)
        return torch.tensor([o.prompt_logprobs[i][s[i]].logprob
                             for o, s in zip(outs, seqs) for i in range(1, len(s))])

    return logprobs(exact_llm), logprobs(llm)


def test_kernels_stay_close_to_the_exact_path(llm, llm_gguf, chat_prompts):
    """The 8-bit activations' cost in accuracy, teacher-forced: the chat prompts and the
    exact engine's 32 greedy tokens after each, scored by both engines. Measured: mean
    |logprob difference| 0.064, max 0.76, perplexity -2.1%. The perplexity ratio on these ~290 tokens is noisy: rounding each
    8-bit activation is a step function, so float-rounding changes upstream move it (the
    previous kernel gave -1.4%, and +0.6% with x scaled by 1 + 2^-22); hence a 4% bound
    (benchmarks/quant_accuracy.py has the held-out figures)."""
    assert not isinstance(llm.engine.executor.driver_worker.model.lm_head.method, GGUFWeight)
    exact, ours = teacher_forced(llm, llm_gguf, chat_prompts)
    diff = (ours - exact).abs()
    assert float(diff.mean()) < 0.15 and float(diff.max()) < 1.5
    assert abs(math.exp(float(exact.mean() - ours.mean())) - 1) < 0.04  # perplexity ratio
