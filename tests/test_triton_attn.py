"""Triton paged-attention kernels against ``ReferenceAttention``.

Without CUDA the kernels run on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``,
set in conftest.py before triton is imported): slow, so the shapes are tiny. The same tests
run compiled on a GPU (``pytest -m cuda``), where bfloat16 is checked too.
"""

from __future__ import annotations

import pytest
import torch

CUDA = torch.cuda.is_available()
pytest.importorskip("triton")  # TRITON_INTERPRET=1 is set in conftest.py when there is no GPU

from pagedserve.attention import AttentionMetadata, get_attention_backend, triton_attn
from pagedserve.attention.torch_attn import ReferenceAttention, write_kv_slots
from pagedserve.attention.triton_attn import TritonAttention

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(
        not triton_attn.INTERPRET, reason="kernels compiled for CUDA; CPU needs TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=[pytest.mark.cuda,
                                pytest.mark.skipif(not CUDA, reason="needs a CUDA device")]),
]


def make_batch(ctx_q: list[tuple[int, int]], block_size: int, num_kv_heads: int, group: int,
               head_dim: int, device: str, dtype=torch.float32, seed: int | None = None):
    """A random step: sequence i has ``ctx_q[i][0]`` cached tokens and ``ctx_q[i][1]`` new
    ones (decodes, q=1, must come first). Blocks are a random permutation of a pool with
    spare blocks; cache and queries are random normals (never zeros)."""
    gen = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    seq_lens = [c + q for c, q in ctx_q]
    query_lens = [q for _, q in ctx_q]
    assert query_lens == sorted(query_lens, key=lambda n: n != 1), "decodes first"
    blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(ctx_q), max(blocks), dtype=torch.int64)
    used = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = perm[used : used + n]
        used += n
    qsl = torch.zeros(len(ctx_q) + 1, dtype=torch.int64)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    slots = [int(tables[i, p // block_size]) * block_size + p % block_size
             for i, (c, q) in enumerate(ctx_q) for p in range(c, c + q)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=device),
        query_start_loc=qsl.to(device),
        seq_lens=torch.tensor(seq_lens, device=device),
        block_tables=tables.to(device),
        query_lens_list=query_lens,
        seq_lens_list=seq_lens,
        num_decodes=sum(1 for q in query_lens if q == 1),
        block_size=block_size,
    )
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    query = torch.randn(sum(query_lens), num_kv_heads * group, head_dim, generator=gen)
    return query.to(device, dtype), cache.to(device, dtype), meta


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


# Decodes (1 cached token .. several partitions), then prefills: a fresh prompt, a cached
# prefix ending mid-block, a prefix of whole blocks with a chunk longer than one tile.
MIXED = [(0, 1), (6, 1), (69, 1), (0, 7), (6, 9), (16, 21)]

CASES = [  # block_size, kv_heads, group, head_dim, sliding_window
    (4, 2, 1, 16, None),
    (16, 1, 3, 32, None),
    (4, 2, 3, 16, 5),
    (16, 2, 1, 32, 19),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size,kv_heads,group,head_dim,window", CASES)
def test_mixed_batch_matches_reference(device, block_size, kv_heads, group, head_dim, window):
    query, cache, meta = make_batch(MIXED, block_size, kv_heads, group, head_dim, device)
    scale = head_dim**-0.5
    ref = ReferenceAttention().forward(query, cache, meta, scale, window)
    out = TritonAttention(partition_size=16).forward(query, cache, meta, scale, window)
    assert rel_err(out, ref) < 1e-3
    # Every token's output, not only the norm: no row may be left unwritten.
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("partition_size", [256, 16, 48])
def test_decode_splits(device, partition_size):
    """Split-K decode: one split, many splits with empty trailing partitions for the short
    sequences."""
    ctx_q = [(n - 1, 1) for n in (1, 3, 16, 17, 50, 97)]
    query, cache, meta = make_batch(ctx_q, 4, 2, 3, 16, device)
    ref = ReferenceAttention().forward(query, cache, meta, 0.25)
    out = TritonAttention(partition_size=partition_size).forward(query, cache, meta, 0.25)
    assert rel_err(out, ref) < 1e-3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("partition_size,window", [(256, None), (16, None), (16, 40)])
@pytest.mark.parametrize("lens", [(1, 2, 5), (1, 40, 97)])
def test_decode_fixed_split_layout(device, partition_size, window, lens):
    """The layout CUDA graphs freeze: splits chosen for ``max_decode_seq_len`` (128)
    whatever the actual lengths, so short sequences leave most partitions empty."""
    query, cache, meta = make_batch([(n - 1, 1) for n in lens], 4, 2, 3, 16, device)
    ref = ReferenceAttention().forward(query, cache, meta, 0.25, window)
    meta.max_decode_seq_len = 128
    out = TritonAttention(partition_size=partition_size).forward(query, cache, meta, 0.25, window)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 1e-3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [None, 40])
def test_decode_row_batch_invariant(device, window):
    """A decode row gets the same bits alone, beside longer contexts (more splits), and in a
    CUDA graph's fixed launch (max_decode_seq_len): its partitions are fixed."""
    query, cache, meta = make_batch([(n - 1, 1) for n in (37, 5, 97, 60)], 4, 2, 3, 16, device)
    attention = TritonAttention(partition_size=16)
    batched = attention.forward(query, cache, meta, 0.25, window)
    meta.max_decode_seq_len = 160
    graphed = attention.forward(query, cache, meta, 0.25, window)
    alone_meta = AttentionMetadata(  # row 0 alone, over the same blocks
        slot_mapping=meta.slot_mapping[:1], query_start_loc=meta.query_start_loc[:2],
        seq_lens=meta.seq_lens[:1], block_tables=meta.block_tables[:1],
        query_lens_list=[1], seq_lens_list=meta.seq_lens_list[:1], num_decodes=1,
        block_size=meta.block_size)
    alone = attention.forward(query[:1], cache, alone_meta, 0.25, window)
    assert torch.equal(batched[:1], alone) and torch.equal(graphed, batched)


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_small_tiles_many_programs(device):
    """Small prefill tiles: many programs per sequence, spare programs between sequences
    and after the last one, a head_dim that is not a power of two."""
    ctx_q = [(0, 2), (3, 5), (0, 13), (9, 3)]
    query, cache, meta = make_batch(ctx_q, 4, 1, 3, 24, device)
    ref = ReferenceAttention().forward(query, cache, meta, 0.2, 6)
    out = TritonAttention(prefill_rows=16).forward(query, cache, meta, 0.2, 6)
    assert rel_err(out, ref) < 1e-3


@pytest.mark.parametrize("device", DEVICES)
def test_bfloat16_cache_under_float32_query(device):
    """--kv-cache-dtype bfloat16: K/V rounded as they are written, widened as they are read."""
    query, cache, meta = make_batch(MIXED, 4, 2, 3, 16, device)
    cache = cache.to(torch.bfloat16)
    ref = ReferenceAttention().forward(query, cache.float(), meta, 0.25)
    out = TritonAttention(partition_size=16).forward(query, cache, meta, 0.25)
    assert out.dtype == torch.float32
    assert rel_err(out, ref) < 1e-3
    key = torch.randn(meta.slot_mapping.shape[0], 2, 16, device=device)
    TritonAttention().write_kv(key, key * 3, cache, meta)
    # within one bfloat16 step (2^-7 relative): CUDA rounds to nearest even, Triton's
    # interpreter truncates
    written = cache.view(2, -1, 2, 16)[:, meta.slot_mapping].float()
    torch.testing.assert_close(written[0], key, rtol=2**-7, atol=0)
    torch.testing.assert_close(written[1], key * 3, rtol=2**-7, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_write_kv_matches_index_copy(device):
    num_kv_heads, head_dim, block_size = 3, 16, 4
    _, cache, meta = make_batch([(0, 1), (5, 1), (2, 6)], block_size, num_kv_heads, 1,
                                head_dim, device)
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    num_tokens = meta.slot_mapping.shape[0]
    # k and v as the model makes them: strided views of one fused projection
    qkv = torch.randn(num_tokens, 3, num_kv_heads, head_dim, generator=gen).to(device)
    key, value = qkv[:, 1], qkv[:, 2]
    expected = cache.clone()
    write_kv_slots(key, value, expected, meta.slot_mapping)
    TritonAttention().write_kv(key, value, cache, meta)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_write_kv_skips_negative_slots(device):
    _, cache, meta = make_batch([(0, 3)], 4, 1, 1, 16, device)
    meta.slot_mapping[1] = -1  # a padding token
    before = cache.clone()
    key = torch.randn(3, 1, 16, device=device)
    TritonAttention().write_kv(key, key + 1, cache, meta)
    flat = cache.view(2, -1, 1, 16)
    slots = meta.slot_mapping.tolist()
    for t in (0, 2):
        assert torch.equal(flat[0, slots[t]], key[t]) and torch.equal(flat[1, slots[t]], key[t] + 1)
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[[slots[0], slots[2]]] = False
    assert torch.equal(flat[:, untouched.to(device)], before.view(2, -1, 1, 16)[:, untouched.to(device)])


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_on_gpu(dtype):
    """Llama-3-8B-like heads (32/8, head_dim 128) in half precision, with long contexts."""
    ctx_q = [(n, 1) for n in (1, 100, 1000, 3000)] + [(0, 300), (517, 200)]
    query, cache, meta = make_batch(ctx_q, 16, 8, 4, 128, "cuda", dtype)
    ref = ReferenceAttention().forward(query, cache, meta, 128**-0.5)
    out = TritonAttention().forward(query, cache, meta, 128**-0.5)
    assert out.dtype == dtype
    assert rel_err(out, ref) < 1e-2


def test_backend_selection():
    assert get_attention_backend("auto", "cpu").name != "triton"
    if triton_attn.INTERPRET or CUDA:
        assert get_attention_backend("triton", "cuda" if CUDA else "cpu").name == "triton"
    if CUDA:
        assert get_attention_backend("auto", "cuda").name == "triton"
    with pytest.raises(ValueError, match="backend must be one of"):
        get_attention_backend("flash", "cpu")


def test_bad_arguments():
    with pytest.raises(ValueError, match="prefill_rows"):
        TritonAttention(prefill_rows=48)
    with pytest.raises(ValueError, match="partition_size"):
        TritonAttention(partition_size=0)
