"""FP4 weights (``--quantization mxfp4|nvfp4``, ggml's MXFP4 / NVFP4 GGUF types): the
formats against references written here from their specs (E2M1 and E4M3 value tables,
the scale rules, ties to even), dequantization against gguf-py, the block kernel against
the dequantized weights, and the methods in the engine against transformers."""

from __future__ import annotations

import copy
import itertools
import math

import numpy as np
import pytest
import torch
from conftest import finish_gguf, gguf_writer, hf_greedy, llama_cpp_permute
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from test_gguf_gemv import a8_reference, a8_round, random_blocks, rel_err, teacher_forced

from pagedserve import LLM, SamplingParams
from pagedserve.cpu_ops import cpu_ops_available, load_cpu_ops
from pagedserve.quantization.base import Linear
from pagedserve.quantization.fp4 import mxfp4_weight, nvfp4_weight
from pagedserve.quantization.fp4_formats import (
    dequantize_e2m1,
    dequantize_mxfp4,
    dequantize_nvfp4,
    nvfp4_ggml_parts,
    nvfp4_kernel_rows,
    quantize_mxfp4,
    quantize_nvfp4,
)
from pagedserve.quantization.gguf import GGUFWeight, repack_blocks

pytestmark = pytest.mark.skipif(not cpu_ops_available(), reason="C++ CPU kernels unavailable")

# -- references from the specs ------------------------------------------------------------

# OCP MX v1.0, section 5.3.3: E2M1, bias 1, codes 0..7 of magnitude (sign bit 3).
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e4m3_values() -> list[float]:
    """Every finite non-negative OCP FP8 E4M3 value by code (bias 7, subnormals at
    exponent 0, code 0x7F NaN), code order."""
    out = []
    for code in range(0x7F):
        e, m = code >> 3, code & 7
        out.append(m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return out


E4M3 = e4m3_values()


def nearest_even(v: float, table: list[float]) -> int:
    """The code of the table value nearest |v| (clamped to the largest), ties to the even
    code."""
    m = min(abs(v), table[-1])
    dist = [abs(m - t) for t in table]
    best = [c for c, d in enumerate(dist) if d == min(dist)]
    return best[0] if len(best) == 1 else next(c for c in best if c % 2 == 0)


def ref_e2m1(v: float) -> int:
    return nearest_even(v, E2M1) | (8 if v < 0 else 0)


def ref_mxfp4_block(v: np.ndarray) -> tuple[int, list[int]]:
    """OCP MX v1.0 section 6.3: X = 2^(floor(log2(max|v|)) - 2), elements E2M1(v / X)."""
    amax = float(np.abs(v).max())
    if amax == 0:
        return 0, [ref_e2m1(float(x)) for x in v]
    exponent = math.frexp(amax)[1] - 1 - 2  # floor(log2(amax)) - emax_elem
    scale = 2.0 ** exponent
    return exponent + 127, [ref_e2m1(float(x) / scale) for x in v]


# -- the formats --------------------------------------------------------------------------


def mxfp4_codes(blocks: torch.Tensor) -> list[list[int]]:
    """The element codes of each MXFP4 block (rows of 17 bytes)."""
    b = blocks.reshape(-1, 17)
    return (torch.cat([b[:, 1:] & 0x0F, b[:, 1:] >> 4], dim=1)).tolist()


def test_e2m1_rounding_matches_the_spec():
    """Every value, every midpoint (ties to even), just around each, beyond 6, signs: as
    elements of MXFP4 blocks whose scale is 1 (each block's largest element 7.9, so
    floor(log2(7.9)) - 2 = 0), quantized by the rule alone."""
    values = [x for t in E2M1 for x in (t, -t)]
    mids = [(a + b) / 2 for a, b in itertools.pairwise(E2M1)]
    near = [m + d for m in mids for d in (-1e-3, 1e-3)]
    wide = torch.randn(2000, generator=torch.Generator().manual_seed(0)).clamp(-1.9, 1.9).mul(4)
    xs = values + mids + [-m for m in mids] + near + [6.5, 7.0, -7.5] + wide.tolist()
    xs += [0.0] * (-len(xs) % 31)
    blocks = torch.tensor(xs, dtype=torch.float32).view(-1, 31)
    w = torch.cat([torch.full((blocks.shape[0], 1), 7.9), blocks], dim=1).view(1, -1)
    q = quantize_mxfp4(w, search=False)
    assert q.view(-1, 17)[:, 0].tolist() == [127] * blocks.shape[0]  # X = 2^0
    codes = [c[1:] for c in mxfp4_codes(q)]
    assert codes == [[ref_e2m1(float(x)) for x in row] for row in blocks]
    assert codes[0][len(values):len(values) + len(mids)] == [0, 2, 2, 4, 4, 6, 6]
    with pytest.raises(ValueError, match="NaN"):
        quantize_mxfp4(torch.tensor([[float("nan")] * 32]))


def test_e4m3_scale_rounding_matches_the_spec():
    """NVFP4 block scales E4M3(max|block| / (6 g)) for wanted scales at every E4M3 value,
    every midpoint between neighbours (ties to even), random values, and above 448
    (clamped): one block a row, the first row's 2688 making 6 g = 6 exactly."""
    mids = [(a + b) / 2 for a, b in itertools.pairwise(E4M3)]
    rand = torch.rand(2000, generator=torch.Generator().manual_seed(1)).mul(17).sub(10)
    wanted = [448.0] + E4M3 + mids + torch.pow(2.0, rand).tolist()
    w = torch.zeros(len(wanted), 16)
    w[:, 0] = torch.tensor(wanted) * 6
    w[0, 0] = 2688.0
    _, scales, global_scale = quantize_nvfp4(w, search=False)
    assert global_scale.item() == 1.0
    want = [float(np.float32(np.float32(x) / np.float32(6.0))) for x in w[:, 0].tolist()]
    assert scales[:, 0].float().tolist() == [E4M3[nearest_even(x, E4M3)] for x in want]


def test_mxfp4_quantization_matches_the_spec_and_gguf_py():
    """Scale bytes and codes per block as section 6.3 gives them (zero block, tiny and large
    blocks too); the blocks dequantize bit-equal by gguf-py and by ours."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(6, 128, generator=gen) * torch.tensor([1e-3, 0.02, 1.0, 7.9, 300.0, 1.0])[:, None]
    w[5, :32] = 0
    blocks = quantize_mxfp4(w, search=False)
    assert blocks.shape == (6, 4 * 17) and blocks.dtype == torch.uint8
    for r in range(6):
        for b in range(4):
            e, codes = ref_mxfp4_block(w[r, 32 * b:32 * (b + 1)].numpy())
            assert int(blocks[r, 17 * b]) == e
            assert mxfp4_codes(blocks[r, 17 * b:17 * (b + 1)])[0] == codes
    ours = dequantize_mxfp4(blocks)
    assert torch.equal(ours, torch.from_numpy(dequantize(blocks.numpy(), Q.MXFP4).copy()))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.zeros(2, 48))


def test_nvfp4_quantization_matches_the_spec():
    """The tensor scale, each block's E4M3 scale and E2M1 codes as NVIDIA's rule gives
    them, computed here in float32 as the rule's reference code does."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(4, 64, generator=gen) * torch.tensor([1e-4, 0.05, 1.0, 20.0])[:, None]
    w[1, 16:32] = 0
    codes, scales, global_scale = quantize_nvfp4(w, search=False)
    f32 = np.float32
    amax = f32(np.abs(w.numpy()).max())
    assert global_scale.item() == f32(amax / f32(448.0 * 6.0))
    for r in range(4):
        for b in range(4):
            block = w[r, 16 * b:16 * (b + 1)].numpy()
            want = f32(f32(np.abs(block).max()) / f32(f32(6.0) * global_scale.numpy()))
            scale = E4M3[nearest_even(float(want), E4M3)]
            assert scales[r, b].float().item() == scale
            step = f32(f32(scale) * global_scale.numpy())
            expected = [ref_e2m1(float(f32(x / step))) if step > 0 else 0 for x in block]
            assert codes[r, 16 * b:16 * (b + 1)].tolist() == expected
    assert torch.equal(dequantize_nvfp4(codes, scales, global_scale)[1, 16:32], torch.zeros(16))
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize_nvfp4(torch.zeros(2, 24))


def test_scale_search_keeps_the_format_and_lowers_the_error():
    """With the search (the default), each block's scale is the rule's or a neighbour
    (MXFP4: one power of two either side; NVFP4: four E4M3 codes either side), its
    elements round to nearest for that scale, and no block's squared error is above the
    rule's; over these Gaussian weights the total error is lower."""
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(7)) * 0.02
    rule, best = quantize_mxfp4(w, search=False), quantize_mxfp4(w)
    err = {name: (dequantize_mxfp4(q) - w).pow(2).view(-1, 32).sum(1)
           for name, q in (("rule", rule), ("best", best))}
    assert bool((err["best"] <= err["rule"]).all()) and err["best"].sum() < err["rule"].sum()
    e_rule, e_best = rule.view(-1, 17)[:, 0].long(), best.view(-1, 17)[:, 0].long()
    assert bool(((e_best - e_rule).abs() <= 1).all()) and bool((e_best != e_rule).any())
    blocks = w.view(-1, 32)
    for i in range(0, blocks.shape[0], 37):
        scale = 2.0 ** (int(e_best[i]) - 127)
        assert mxfp4_codes(best.view(-1, 17)[i])[0] == [ref_e2m1(float(x) / scale)
                                                         for x in blocks[i]]
    rule, best = quantize_nvfp4(w, search=False), quantize_nvfp4(w)
    assert torch.equal(rule[2], best[2])  # the tensor scale
    err = {name: (dequantize_nvfp4(*q) - w).pow(2).view(-1, 16).sum(1)
           for name, q in (("rule", rule), ("best", best))}
    assert bool((err["best"] <= err["rule"]).all()) and err["best"].sum() < err["rule"].sum()
    c_rule, c_best = (q[1].view(torch.uint8).long().view(-1) for q in (rule, best))
    assert bool(((c_best - c_rule).abs() <= 4).all()) and bool((c_best != c_rule).any())
    g = float(best[2])
    for i in range(0, c_best.shape[0], 101):
        step = float(np.float32(E4M3[int(c_best[i])] * np.float32(g)))
        assert best[0].view(-1, 16)[i].tolist() == [ref_e2m1(float(np.float32(x / step)))
                                                     for x in w.view(-1, 16)[i].numpy()]


def test_ggml_nvfp4_converts_value_for_value():
    """ggml's NVFP4 blocks of 64 (four unsigned E4M3 sub-scales) -> codes and halved
    sub-scales whose product is gguf-py's dequantization, bit for bit."""
    rows = random_blocks(Q.NVFP4, 32, 192, np.random.default_rng(4))
    codes, half_scales = nvfp4_ggml_parts(torch.from_numpy(rows))
    doubled = 2 * dequantize_e2m1(codes).view(32, -1, 16)
    ours = (doubled * half_scales.unsqueeze(-1)).view(32, -1)
    assert torch.equal(ours, torch.from_numpy(dequantize(rows, Q.NVFP4).copy()))


def test_nvfp4_kernel_tiles_hold_the_rows_and_their_scales():
    """Per row and block of 32: fp16 scales of elements 0..15 and 16..31, then the nibbles
    (Q4_1's shape, repacked as Q4_1's), and after each tile its 16 row scales."""
    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (32, 64), generator=gen, dtype=torch.uint8)
    half_scales = torch.rand(32, 4, generator=gen).to(torch.float8_e4m3fn).float() * 0.5
    row_scales = torch.rand(32, generator=gen)
    tiles = nvfp4_kernel_rows(codes, half_scales, row_scales)
    assert tiles.shape == (2, 2 * 320 + 64)
    blocks = codes.view(32, 2, 32)
    rows = torch.cat([half_scales.half().view(32, 2, 2).view(torch.uint8),
                      blocks[..., :16] | (blocks[..., 16:] << 4)], dim=-1).reshape(32, -1)
    expected = torch.cat([repack_blocks(rows, Q.Q4_1),
                          row_scales.view(torch.uint8).view(2, 64)], dim=1)
    assert torch.equal(tiles, expected)
    with pytest.raises(ValueError, match="exact in fp16"):
        nvfp4_kernel_rows(codes, half_scales + 1e-6, row_scales)
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4_kernel_rows(codes[:8], half_scales[:8], row_scales[:8])


# -- the kernel with our quantizers -------------------------------------------------------


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("n, k", [(16, 32), (48, 576), (64, 1536)])
def test_kernel_matches_the_dequantized_weights(fmt, n, k):
    """The kernel = x rounded to 8 bits per block of 32, times the weight as the format
    dequantizes it (NVFP4 with a tensor scale far from 1)."""
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen) * 0.03
    if fmt == "mxfp4":
        weight, deq = mxfp4_weight(w), dequantize_mxfp4(quantize_mxfp4(w))
    else:
        weight, deq = nvfp4_weight(w), dequantize_nvfp4(*quantize_nvfp4(w))
    ops = load_cpu_ops()
    for m in (1, 3, 8, 19):
        x = torch.randn(m, k, generator=gen)
        out = ops.ggml_mul_mat_a8(weight.qweight, x, int(weight.qtype))
        assert rel_err(out, a8_reference(x, deq)) < 2e-6
        assert torch.equal(out[-1], ops.ggml_mul_mat_a8(weight.qweight, x[-1:],
                                                        int(weight.qtype))[0])


# -- the methods in the engine ------------------------------------------------------------


GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def write_fp4_gguf(model, path, qtype: Q, rng: np.random.Generator) -> None:
    """The HF Llama ``model`` as a GGUF file whose linear weights are ggml ``qtype`` blocks
    (MXFP4 quantized by gguf-py; NVFP4 random blocks, which gguf-py cannot make); the
    weights as gguf-py dequantizes them are written back into ``model``."""
    c = model.config
    w = gguf_writer(path, "llama", c)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_rope_freq_base(c.rope_theta if hasattr(c, "rope_theta") else 10000.0)
    state = model.state_dict()
    for name, tensor in state.items():
        array = tensor.float().numpy()
        parts = name.split(".")
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            gname = f"blk.{parts[2]}.{GGUF_NAMES['.'.join(parts[3:-1])]}.weight"
        if gname.endswith("norm.weight") or gname == "token_embd.weight":
            w.add_tensor(gname, array)
            continue
        heads = {"attn_q": c.num_attention_heads, "attn_k": c.num_key_value_heads}
        kind = gname.split(".")[-2]
        stored = llama_cpp_permute(array, heads[kind]) if kind in heads else array
        if qtype == Q.MXFP4:
            data = quantize(stored, qtype)
        else:
            data = random_blocks(qtype, *stored.shape, rng)
            blocks = data.reshape(data.shape[0], -1, 36)  # sub-scales 0.125 .. 0.23 halved
            blocks[..., :4] = rng.integers(0x28, 0x30, blocks[..., :4].shape)
        deq = dequantize(data, qtype).reshape(stored.shape)
        if kind in heads:  # back to HF rows: the inverse permutation
            n = heads[kind]
            deq = deq.reshape(n, deq.shape[0] // n // 2, 2, -1).swapaxes(1, 2).reshape(deq.shape)
        tensor.copy_(torch.from_numpy(np.ascontiguousarray(deq)))
        w.add_tensor(gname, data, raw_shape=data.shape, raw_dtype=qtype)
    finish_gguf(w)


@pytest.mark.parametrize("qtype", [Q.MXFP4, Q.NVFP4])
def test_gguf_fp4_file_computes_from_its_blocks(tiny_llama, tmp_path, qtype):
    """A GGUF file of ggml MXFP4 / NVFP4 tensors loads as it is: by default every Linear
    computes from the file's blocks, and greedy decoding equals transformers on the
    weights gguf-py dequantizes from them, every Linear's input rounded to 8 bits per block
    of 32 as the kernel rounds it."""
    model = copy.deepcopy(tiny_llama[1])
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    write_fp4_gguf(model, path, qtype, np.random.default_rng(6))
    llm = LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", block_size=4,
              max_model_len=128, kv_cache_memory_bytes=8 << 20)
    layers = [m for m in llm.engine.executor.driver_worker.model.modules()
              if isinstance(m, Linear)]
    assert len(layers) == 4 * 2 + 1
    assert all(isinstance(m.method, GGUFWeight) and m.method.qtype == qtype for m in layers)
    same = LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", block_size=4,
               max_model_len=128, kv_cache_memory_bytes=8 << 20, quantization=qtype.name.lower())
    same_layers = [m for m in same.engine.executor.driver_worker.model.modules()
                   if isinstance(m, Linear)]
    assert all(torch.equal(a.method.qweight, b.method.qweight)
               for a, b in zip(layers, same_layers))  # the file's blocks, not requantized
    prompts = [[1, 5, 9, 33, 60], [2, 70, 71, 4], [17] * 6]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for layer in model.modules():
        if isinstance(layer, torch.nn.Linear):
            layer.register_forward_pre_hook(lambda _, args: (a8_round(args[0]),))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 8, None)


@pytest.fixture(scope="module", params=["mxfp4", "nvfp4"])
def llm_fp4(request):
    """The bundled model in float32 with every Linear quantized to FP4 at load."""
    return LLM(dtype="float32", quantization=request.param, max_model_len=1024,
               kv_cache_memory_bytes=256 << 20)


def test_engine_quantizes_every_linear_at_load(llm_fp4):
    """Every Linear (fused q/k/v and gate/up, the tied head) holds FP4 tiles, and no float
    copy, whose product is their dequantized weight (``ggml_get_rows``, tested against
    gguf-py and the NVFP4 reference) times 8-bit activations; MXFP4's dequantized weights
    are the format's values (quantizing them again gives them back)."""
    model = llm_fp4.engine.executor.driver_worker.model
    qtype = Q.MXFP4 if llm_fp4.engine.args.quantization == "mxfp4" else Q.NVFP4
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(layers) == 4 * 30 + 1
    assert all(isinstance(m.method, GGUFWeight) and m.method.qtype == qtype for m in layers)
    assert all(torch.equal(m.weight, m.method.qweight) for m in layers)
    ops = load_cpu_ops()
    for layer in (*layers[:4], model.lm_head):
        n, k = layer.out_features, layer.in_features
        deq = ops.ggml_get_rows(layer.method.qweight, torch.arange(n), int(qtype))
        assert deq.shape == (n, k)
        if qtype == Q.MXFP4:
            assert torch.equal(dequantize_mxfp4(quantize_mxfp4(deq)), deq)
        x = torch.randn(3, k)
        out = ops.ggml_mul_mat_a8(layer.method.qweight, x, int(qtype))
        assert rel_err(out, a8_reference(x, deq)) < 1e-5


# Measured (teacher-forced on the exact engine's greedy tokens after the chat prompts):
# mean |logprob difference| 1.12 (mxfp4) / 0.75 (nvfp4), max 8.6 / 8.2, perplexity
# +76% / +34%; bounds a little above (benchmarks/quant_accuracy.py has the held-out figures).
BOUNDS = {"mxfp4": (1.4, 12.0, 1.0), "nvfp4": (0.95, 12.0, 0.45)}


def test_fp4_stays_close_to_the_exact_path(llm, llm_fp4, chat_prompts):
    """FP4's cost in accuracy on the bundled model, whose weights are dequantized Q4_1, so
    FP4 quantizes them a second time (onto another 4-bit grid: a large error for a 135M
    model), teacher-forced on the exact engine's greedy tokens."""
    exact, ours = teacher_forced(llm, llm_fp4, chat_prompts)
    diff = (ours - exact).abs()
    mean_bound, max_bound, ppl_bound = BOUNDS[llm_fp4.engine.args.quantization]
    assert float(diff.mean()) < mean_bound and float(diff.max()) < max_bound
    assert 0 < math.exp(float(exact.mean() - ours.mean())) - 1 < ppl_bound  # perplexity ratio
