"""Batch invariance: a request gets the same bits whatever else the step holds.

Kernel level (hypothesis): row i of an M-row product equals the 1-row product of row i,
bit for bit, for M from 1 to 300, for every linear kernel (fixed-order float32 and
bfloat16, GGUF Q4_1 and Q8_0 blocks, int8 rows), and so does the row-wise log-sum-exp;
attention gives a prompt's rows the same bits at once and in chunks. Engine level, on
every path: chats alone (prefix caching off), all together, shuffled among long prompts
that force chunked prefill and preemption (prefix cache warm), and alone again (warm):
greedy ids and logprobs bit-equal, and a seeded sample the same.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from hypothesis import given, settings
from hypothesis import strategies as st
from test_gguf_gemv import random_blocks

from pagedserve import LLM, SamplingParams
from pagedserve.cpu_ops import cpu_ops_available, load_cpu_ops
from pagedserve.quantization.gguf import repack_blocks
from pagedserve.quantization.int8 import Int8Weight, int8_linear

pytestmark = pytest.mark.skipif(not cpu_ops_available(), reason="C++ CPU kernels unavailable")

SHAPES = st.sampled_from([(48, 64), (960, 576), (100, 96), (33, 1536)])  # (N, K)


def rows_alone(multiply, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([multiply(x[i : i + 1]) for i in range(x.shape[0])])


def assert_rows_invariant(multiply, x: torch.Tensor) -> None:
    """Each row of ``multiply(x)`` bit-equal to ``multiply`` of that row alone, and of the
    rows in two uneven parts."""
    whole = multiply(x)
    assert torch.equal(whole, rows_alone(multiply, x))
    cut = max(1, x.shape[0] // 3)
    if cut < x.shape[0]:
        assert torch.equal(whole, torch.cat([multiply(x[:cut]), multiply(x[cut:])]))


@settings(max_examples=12, deadline=None)
@given(m=st.integers(1, 300), shape=SHAPES, dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2**31))
def test_fixed_order_linear_rows_invariant(m, shape, dtype, seed):
    n, k = shape
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen).to(dtype)
    x = torch.randn(m, k, generator=gen).to(dtype)
    ops = load_cpu_ops()
    packed = ops.pack_linear_weight(weight)
    multiply = lambda rows: ops.fixed_order_linear(rows, packed, n)
    assert_rows_invariant(multiply, x)
    exact = x.double() @ weight.double().T
    out = multiply(x)
    assert out.dtype == dtype and out.shape == (m, n)
    # float32 sums of k products: within k ulps of the float64 product's magnitude
    bound = k * torch.finfo(torch.float32).eps * (x.double().abs() @ weight.double().abs().T)
    if dtype == torch.float32:
        assert bool(((out.double() - exact).abs() <= bound).all())
    else:  # one final rounding to bfloat16 on top
        torch.testing.assert_close(out.double(), exact, rtol=2 ** -7, atol=float(bound.max()))


@pytest.mark.parametrize("layout,k", [("fma", 2048), ("pairs", 4096), ("int8", 8192)])
def test_products_rows_invariant_across_row_blocks(layout, k):
    """Rows of 8 KiB (2,048 float32, 4,096 bfloat16 or 8,192 int8 values) cut the GEMMs'
    row blocks down to one chunk of 192 rows wherever L2 holds under 2.9 MiB a core
    (gemm_blocking.h: block_rows): 450 rows are three blocks, the last part-full, each taken
    through every panel in turn. Each row's bits equal its product alone and in two parts."""
    ops = load_cpu_ops()
    gen = torch.Generator().manual_seed(k)
    weight = torch.randn(100, k, generator=gen)
    x = torch.randn(450, k, generator=gen)
    if layout == "fma":
        packed = ops.pack_linear_weight(weight)
        multiply = lambda rows: ops.fixed_order_linear(rows, packed, 100)
    elif layout == "pairs":
        if not ops.pair_linear_available():
            pytest.skip("no bfloat16 pair kernel on this CPU (AVX512-BF16)")
        packed = ops.pack_linear_weight_pairs(weight.bfloat16())
        multiply = lambda rows: ops.fixed_order_linear(rows.bfloat16(), packed, 100)
    else:
        if not ops.packed_int8_available():
            pytest.skip("no packed int8 kernel on this CPU")
        q = weight.mul(40).round().clamp(-127, 127).to(torch.int8)
        quant = Int8Weight(q, torch.full((100,), 0.025), ops.pack_int8_weight(q))
        multiply = lambda rows: int8_linear(rows, quant)
    assert_rows_invariant(multiply, x)


@pytest.mark.parametrize("m,n", [(7, 48), (200, 100), (450, 960)])  # chunks of 192 rows
def test_fixed_order_bfloat16_result_is_its_float32_result_rounded(m, n):
    """The kernel rounds its float32 sums to bfloat16 itself (nearest even): bit for bit
    what Tensor.to(bfloat16) makes of the same sums, here the float32 result of the same
    chains (a bfloat16 row widened to float32 is exact); a NaN stays NaN (0x7FC0, as
    c10::BFloat16 writes it; Tensor.to's vector path writes 0xFFFF)."""
    gen = torch.Generator().manual_seed(m)
    weight = torch.randn(n, 96, generator=gen).bfloat16()
    x = torch.randn(m, 96, generator=gen).bfloat16()
    x[m // 2, 5] = float("nan")
    ops = load_cpu_ops()
    packed = ops.pack_linear_weight(weight)
    rounded = ops.fixed_order_linear(x.float(), packed, n).to(torch.bfloat16)
    out = ops.fixed_order_linear(x, packed, n)
    assert out[m // 2].isnan().all()
    finite = torch.arange(m) != m // 2
    assert torch.equal(out[finite].view(torch.int16), rounded[finite].view(torch.int16))


@settings(max_examples=10, deadline=None)
@given(m=st.integers(1, 300), qtype=st.sampled_from([Q.Q4_1, Q.Q8_0, Q.MXFP4, Q.NVFP4]),
       seed=st.integers(0, 2**31))
def test_gguf_block_kernel_rows_invariant(m, qtype, seed):
    blocks = torch.from_numpy(random_blocks(qtype, 64, 256, np.random.default_rng(seed)))
    qweight = repack_blocks(blocks, qtype)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(seed))
    ops = load_cpu_ops()
    assert_rows_invariant(lambda rows: ops.ggml_mul_mat_a8(qweight, rows, int(qtype)), x)


@settings(max_examples=8, deadline=None)
@given(m=st.integers(1, 300), seed=st.integers(0, 2**31))
def test_int8_rows_invariant(m, seed):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randint(-127, 128, (48, 96), generator=gen, dtype=torch.int8)
    quant = Int8Weight(weight, torch.rand(48, generator=gen) / 100)
    x = torch.randn(m, 96, generator=gen)
    assert_rows_invariant(lambda rows: int8_linear(rows, quant), x)


@settings(max_examples=10, deadline=None)
@given(m=st.integers(1, 300), v=st.sampled_from([5, 1000, 49152]), seed=st.integers(0, 2**31))
def test_row_logsumexp_rows_invariant(m, v, seed):
    x = torch.randn(m, v, generator=torch.Generator().manual_seed(seed)) * 4
    x[0, : v // 2] = float("-inf")
    ops = load_cpu_ops()
    assert_rows_invariant(ops.row_logsumexp, x)
    torch.testing.assert_close(ops.row_logsumexp(x), torch.logsumexp(x.double(), -1).float())
    assert ops.row_logsumexp(torch.full((2, 7), float("-inf"))).tolist() == [float("-inf")] * 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@settings(max_examples=10, deadline=None)
@given(m=st.integers(1, 300), v=st.sampled_from([1, 5, 1000, 49152]), seed=st.integers(0, 2**31))
def test_row_argmax_is_argmax_and_rows_invariant(dtype, m, v, seed):
    """The LM head's own dtype, as greedy sampling passes it: the float32 copy's argmax."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-4, 4, (m, v), generator=gen).to(dtype)  # ties: the first index wins
    x[0] = float("-inf")
    ops = load_cpu_ops()
    assert_rows_invariant(ops.row_argmax, x)
    assert torch.equal(ops.row_argmax(x), x.float().argmax(-1))
    nan_at = torch.randint(0, v, (m,), generator=gen)
    x[torch.arange(m), nan_at] = float("nan")  # a NaN is the maximum, as torch.argmax has it
    assert torch.equal(ops.row_argmax(x), nan_at)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 128])
def test_attention_rows_same_at_once_and_in_chunks(dtype, dim):
    """A 150-token prompt's attention output, computed in one step, equals the same rows
    computed in chunks of 1, 17 and 64 query rows over the same cache (a chunked prefill, a
    prefix-cache hit, decodes), beside other sequences. In bfloat16 with AVX512-BF16, rows of
    a prompt score together with the keys in lanes and a lone row with horizontal sums."""
    ops = load_cpu_ops()
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, block, length = 9, 3, 16, 150
    cache = torch.randn(2, 12, block, kv_heads, dim, generator=gen).to(dtype)
    table = torch.randperm(12, generator=gen)[None]
    query = torch.randn(length, heads, dim, generator=gen).to(dtype)

    def attend(start, stop, others=0):
        """Rows start..stop of the prompt, after `others` one-row sequences."""
        other_rows = torch.randn(others, heads, dim, generator=gen).to(dtype)
        q = torch.cat([other_rows, query[start:stop]])
        lens = torch.tensor([length] * others + [stop])
        tables = table.expand(others + 1, -1).contiguous()
        starts = torch.tensor([*range(others + 1), others + stop - start])
        out = torch.empty_like(q)
        ops.paged_attention(q, cache, tables, lens, starts, out, 0.125, 0)
        return out[others:]

    whole = attend(0, length)
    for chunk, others in ((1, 0), (17, 3), (64, 1)):
        parts = [attend(s, min(s + chunk, length), others) for s in range(0, length, chunk)]
        assert torch.equal(torch.cat(parts), whole)


PATHS = {
    "float32 exact": {"dtype": "float32", "quantization": "none"},
    "float32 GGUF blocks": {"dtype": "float32"},
    "bfloat16 GGUF blocks": {"dtype": "bfloat16"},
    "bfloat16 exact": {"dtype": "bfloat16", "quantization": "none"},
    "int8": {"dtype": "float32", "quantization": "int8"},
    "bfloat16 MXFP4": {"dtype": "bfloat16", "quantization": "mxfp4"},
    "int8, bfloat16 KV cache": {"dtype": "float32", "quantization": "int8",
                                "kv_cache_dtype": "bfloat16"},
}
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=77, max_tokens=12, ignore_eos=True,
                        logprobs=0)


def answers(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[tuple]:
    """(ids, sampled logprobs, top logprobs) of each prompt's one completion."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)],
             [sorted(lp.items()) for lp in c.logprobs])
            for c in (o.outputs[0] for o in outs)]


@pytest.mark.parametrize("path", list(PATHS))
def test_engine_paths_batch_invariant(path, chat_prompts):
    chats = chat_prompts[:5]
    long_prompts = [list(range(1000, 1190)), list(range(2000, 2230))]
    common = dict(PATHS[path], max_model_len=256, max_num_batched_tokens=64, block_size=16)
    alone = LLM(**common, enable_prefix_caching=False, num_gpu_blocks_override=64)
    reference = {kind: [answers(alone, [c], params)[0] for c in chats]
                 for kind, params in (("greedy", GREEDY), ("seeded", SEEDED))}
    del alone
    # 20 blocks of 16 tokens: the long prompts (13-16 blocks each) preempt the chats
    llm = LLM(**common, enable_prefix_caching=True, num_gpu_blocks_override=20)
    for kind, params in (("greedy", GREEDY), ("seeded", SEEDED)):
        assert answers(llm, chats, params) == reference[kind], (path, kind, "together")
        order = list(range(len(chats))) + [-1 - i for i in range(len(long_prompts))]
        random.Random(3).shuffle(order)
        mixed = answers(llm, [chats[i] if i >= 0 else long_prompts[-i - 1] for i in order], params)
        assert [mixed[order.index(i)] for i in range(len(chats))] == reference[kind], (path, kind)
        warm = [answers(llm, [c], params)[0] for c in chats]
        assert warm == reference[kind], (path, kind, "alone, prefix cache warm")
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.kv_cache_stats().prefix_cache_hits > 0
