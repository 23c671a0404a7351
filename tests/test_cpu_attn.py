"""The CPU attention backends (C++ kernel, batched PyTorch) against the reference loop."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedserve.attention.backend import AttentionMetadata
from pagedserve.attention.cpu_attn import CpuAttention
from pagedserve.attention.torch_attn import ReferenceAttention, TorchAttention


def make_batch(q_lens, contexts, heads, kv_heads, head_dim, block_size, dtype=torch.float32):
    """Random query, a random KV pool, and metadata for sequences whose ``contexts[i]``
    earlier tokens sit in shuffled blocks (decodes first, as the model runner orders)."""
    seq_lens = [c + q for c, q in zip(contexts, q_lens)]
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    perm = torch.randperm(num_blocks).tolist()
    tables, used = [], 0
    for n in seq_lens:
        k = -(-n // block_size)
        tables.append(perm[used : used + k])
        used += k
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int64)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64), query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens), block_tables=block_tables, query_lens_list=q_lens,
        seq_lens_list=seq_lens, num_decodes=sum(1 for q in q_lens if q == 1),
        block_size=block_size)
    query = torch.randn(sum(q_lens), heads, head_dim, dtype=dtype)
    return query, kv_cache, meta


CASES = [
    # q_lens, contexts, heads, kv_heads, head_dim, block_size, window
    ([1, 1, 1, 5, 20], [3, 17, 40, 30, 0], 9, 3, 64, 16, None),  # decodes + prefill + prefix mid-block
    ([1, 1, 9], [50, 3, 21], 4, 4, 32, 4, 8),  # MHA, tiny blocks, sliding window
    ([1] * 6, [1, 2, 15, 16, 17, 100], 6, 2, 16, 8, None),  # decode only, ragged
    ([7, 3], [0, 13], 8, 1, 32, 16, 5),  # prefill only, MQA, window
    ([1], [37], 9, 3, 64, 16, None),  # a lone decode: the kernel splits it by KV head
    ([1], [50], 4, 2, 32, 4, 8),  # ... with a window
    ([1, 1, 2], [150, 67, 90], 9, 3, 64, 16, 100),  # several 64-key tiles, ragged tails
    ([1, 1, 3], [200, 9, 70], 8, 2, 128, 16, None),  # head size 128
    ([1, 1, 4], [40, 70, 10], 9, 3, 64, 8, None),  # 16-key runs straddle blocks of 8
]


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.fixture
def two_threads():
    """More threads than a lone decode has rows: the kernel's split-by-KV-head path."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", [CpuAttention, TorchAttention])
def test_backend_matches_reference(case, backend, two_threads):
    q_lens, contexts, heads, kv_heads, head_dim, bs, window = case
    query, kv_cache, meta = make_batch(q_lens, contexts, heads, kv_heads, head_dim, bs)
    ref = ReferenceAttention().forward(query, kv_cache, meta, head_dim**-0.5, window)
    out = backend().forward(query, kv_cache, meta, head_dim**-0.5, window)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("case", CASES)
def test_kernel_all_rows_match_reference(case):
    """The kernel itself handles prefill rows too (the backend routes only decodes)."""
    q_lens, contexts, heads, kv_heads, head_dim, bs, window = case
    query, kv_cache, meta = make_batch(q_lens, contexts, heads, kv_heads, head_dim, bs)
    ref = ReferenceAttention().forward(query, kv_cache, meta, 0.3, window)
    out = torch.empty_like(query)
    CpuAttention().ops.paged_attention(query, kv_cache, meta.block_tables, meta.seq_lens,
                                       meta.query_start_loc, out, 0.3, window or 0)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_lens", [[1] * 40 + [9, 30], [1]])
def test_kernel_bits_do_not_depend_on_the_threads(dtype, q_lens):
    """Threads start with runs of rows of equal cost and then take each other's last rows
    (csrc/work_sharing.h), a taken row reading its keys from a stream of its own: every
    row's bits are those of one thread, on six threads too (more than the cores here, so
    that some threads fall behind and the others take their rows)."""
    torch.manual_seed(0)
    contexts = torch.randint(0, 300, (len(q_lens),)).tolist()
    query, kv_cache, meta = make_batch(q_lens, contexts, 9, 3, 64, 16, dtype)

    def attend(threads: int) -> torch.Tensor:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            out = torch.empty_like(query)
            CpuAttention().ops.paged_attention(query, kv_cache, meta.block_tables, meta.seq_lens,
                                               meta.query_start_loc, out, 0.125, 0)
        finally:
            torch.set_num_threads(before)
        return out

    one = attend(1)
    ref = ReferenceAttention().forward(query.float(), kv_cache.float(), meta, 0.125)
    assert rel_err(one, ref) < (1e-5 if dtype == torch.float32 else 4e-3)
    for _ in range(5):
        assert torch.equal(attend(6), one)


def test_kernel_bfloat16():
    query, kv_cache, meta = make_batch([1, 1, 4], [30, 70, 10], 9, 3, 64, 16, torch.bfloat16)
    ref = ReferenceAttention().forward(query, kv_cache, meta, 0.125)
    out = CpuAttention().forward(query, kv_cache, meta, 0.125)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("case", CASES)
def test_kernel_bfloat16_rows_match_float32_on_the_same_values(case, two_threads):
    """A bfloat16 query over a bfloat16 cache (scores and P.V by vdpbf16ps where the CPU has
    it: exact products, float32 sums, P rounded to bfloat16) equals float32 attention over
    the same values widened, but for those roundings (2**-9 relative each)."""
    q_lens, contexts, heads, kv_heads, head_dim, bs, window = case
    query, kv_cache, meta = make_batch(q_lens, contexts, heads, kv_heads, head_dim, bs)
    query, kv_cache = query.bfloat16(), kv_cache.bfloat16()
    ref = ReferenceAttention().forward(query.float(), kv_cache.float(), meta, 0.3, window)
    out = torch.empty_like(query)
    CpuAttention().ops.paged_attention(query, kv_cache, meta.block_tables, meta.seq_lens,
                                       meta.query_start_loc, out, 0.3, window or 0)
    assert rel_err(out, ref) < 4e-3


def test_kernel_bfloat16_run_of_keys_over_scattered_small_blocks():
    """Blocks of 4: keys 0-15 sit in blocks 1, 6, 0 and 4, so the run's first and last rows
    are 15 rows apart in memory as if the blocks were 1-4 in order; a kernel that took the
    run's ends for the whole run would read blocks 2 and 3 in place of 6 and 0."""
    query, kv_cache, meta = make_batch([1], [19], 9, 3, 64, 4, torch.bfloat16)
    meta = dataclasses.replace(meta, block_tables=torch.tensor([[1, 6, 0, 4, 7]]))
    ref = ReferenceAttention().forward(query.float(), kv_cache.float(), meta, 0.3)
    out = torch.empty_like(query)
    CpuAttention().ops.paged_attention(query, kv_cache, meta.block_tables, meta.seq_lens,
                                       meta.query_start_loc, out, 0.3, 0)
    assert rel_err(out, ref) < 4e-3


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", [CpuAttention, TorchAttention])
def test_bfloat16_cache_under_float32_query(case, backend, two_threads):
    """--kv-cache-dtype bfloat16: attention over the bf16 cache equals float32 attention
    over the same values widened (only the storage is rounded)."""
    q_lens, contexts, heads, kv_heads, head_dim, bs, window = case
    query, kv_cache, meta = make_batch(q_lens, contexts, heads, kv_heads, head_dim, bs)
    kv_cache = kv_cache.to(torch.bfloat16)
    ref = ReferenceAttention().forward(query, kv_cache.float(), meta, head_dim**-0.5, window)
    out = backend().forward(query, kv_cache, meta, head_dim**-0.5, window)
    assert out.dtype == torch.float32
    assert rel_err(out, ref) < 1e-5


def test_kernel_refuses_a_cache_of_another_dtype():
    query, kv_cache, meta = make_batch([1], [20], 4, 2, 32, 16)
    out = torch.empty_like(query)
    with pytest.raises(RuntimeError, match="query's dtype or bfloat16"):
        CpuAttention().ops.paged_attention(query, kv_cache.half(), meta.block_tables,
                                           meta.seq_lens, meta.query_start_loc, out, 0.3, 0)
