"""Paged attention in Triton: the CUDA backend (and, under ``TRITON_INTERPRET=1``, on CPU).

Three kernels behind the ``AttentionBackend`` interface:

* ``_write_kv_kernel``: one program per new token copies its K and V rows into the slot
  ``slot_mapping[t]`` (block_id * block_size + offset) of the layer's cache. A negative
  slot means "padding, skip".
* ``_decode_kernel`` + ``_reduce_kernel``: one new token per sequence. Program
  ``(seq, kv_head, split)`` reads the keys of one *partition* of the context (a run of
  ``partition_size`` tokens) through the block table, once for all ``group`` query heads
  that share the KV head (GQA), and keeps an online softmax. With more than one split
  (long contexts, small batches) each program writes its partial ``(acc, max, sum)`` and
  the reduce kernel merges the partitions, as PagedAttention v2 / flash-decoding do::

      context:  |---- split 0 ----|---- split 1 ----|-- split 2 --|
      out = sum_s exp(m_s - M) * acc_s / sum_s exp(m_s - M) * l_s,   M = max_s m_s

* ``_prefill_kernel``: the flat batch of sequences with several new tokens (prompts,
  prompt chunks after a cached prefix). Program ``(tile, kv_head)`` takes ``BLOCK_Q``
  query tokens of one sequence times the ``group`` query heads of one KV head as the rows
  of its tile, and walks the keys ``[window start, last query position]`` of that
  sequence through the block table; causal within the new tokens. Tiles are numbered
  without any host-side table: sequence ``j``'s tiles start at
  ``query_start_loc[j] // BLOCK_Q + j`` (strictly increasing in ``j``, and each gap is
  at least the sequence's tile count), so a program finds its sequence by binary search
  over ``query_start_loc``.

Keys are read token by token (``block_table[n // block_size]``), so a tile of ``TILE_N``
keys may span several blocks, any block size works, and tiles need no alignment.
All arithmetic is in float32 with base-2 exponentials; float32 inputs use IEEE dot
products (no TF32), so the kernels match ``ReferenceAttention`` to ~1e-6. A bfloat16
cache under a float32 model (``--kv-cache-dtype bfloat16``) is widened to the query's
dtype as it is loaded.

The kernels are compiled for CUDA tensors, or interpreted on CPU tensors when
``TRITON_INTERPRET=1`` is set before this module is imported (slow; used by the tests).
No kernel launch here reads a device tensor on the host: shapes come from the
metadata's Python lists. What is fixed per model (head counts, head_dim, block size,
tiles, window on/off, dtype) is a compile-time constant; what changes per step (split
count, partition size, number of prefills) is a runtime argument, so a model compiles a
handful of kernel variants once.

Batch invariance: a decode row's context is cut at fixed positions, partitions of
``partition_size`` tokens from its own window start, whatever the batch, so the order of
its sums never depends on what else runs. The batch (its longest context, or a CUDA
graph's ``max_decode_seq_len``) only sets how many partitions are launched; those past a
sequence's end are empty (max -inf, sum 0, acc 0) and add exact zeros in the reduce.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pagedserve.attention.backend import AttentionMetadata

try:  # triton >= 3.4
    from triton import knobs as _knobs

    INTERPRET = bool(_knobs.runtime.interpret)
except (ImportError, AttributeError):  # pragma: no cover - older triton
    INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")

if INTERPRET and type(tl.standard.zeros).__name__ != "InterpretedFunction":
    raise ImportError("TRITON_INTERPRET=1 was set after triton was first imported (torch._dynamo "
                      "imports it); set it before the process imports torch._dynamo or triton")

_LOG2E = 1.4426950408889634
_MIN_DOT_ROWS = 16  # tl.dot on tensor cores wants >= 16 rows; pad the GQA group up to it
# Context tokens per decode split: a 4k context spreads over 16 programs per KV head (the
# parallelism flash-decoding wants for few, long sequences), a short one takes one.
PARTITION_SIZE = 256


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_c_kv, stride_c_slot, stride_c_h,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    H_PAD: tl.constexpr, D_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, D_PAD)[None, :]
    # (slot broadcast to the block first: the interpreter rejects block & scalar masks)
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM) & ((h + d) * 0 + slot >= 0)
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    dst = cache_ptr + slot * stride_c_slot + h * stride_c_h + d
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_c_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _decode_kernel(
    q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    scale_log2, window, partition_size, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_c_kv, stride_c_block, stride_c_slot, stride_c_h, stride_bt,
    NUM_HEADS: tl.constexpr, SINGLE_SPLIT: tl.constexpr,
    GROUP: tl.constexpr, G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    ctx_lo = 0
    if USE_WINDOW:
        ctx_lo = tl.maximum(seq_len - window, 0)
    start = ctx_lo + split * partition_size
    end = tl.minimum(start + partition_size, seq_len)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    heads = kvh * GROUP + g
    q_mask = (g < GROUP)[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=q_mask, other=0.0)

    m = tl.full([G_PAD], float("-inf"), tl.float32)
    l = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    for tile in range(start, end, TILE_N):
        n = tile + tl.arange(0, TILE_N)
        n_ok = n < end
        block = tl.load(table + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        off = block * stride_c_block + (n % BLOCK_SIZE) * stride_c_slot + kvh * stride_c_h
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(cache_ptr + off[:, None] + d[None, :], mask=kv_mask,
                    other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [G_PAD, TILE_N]
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))  # finite: every tile has a valid key
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(cache_ptr + stride_c_kv + off[:, None] + d[None, :], mask=kv_mask,
                    other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    if SINGLE_SPLIT:
        out = acc / l[:, None]
        tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        row = (seq * NUM_HEADS + heads) * num_splits + split  # [G_PAD]
        g_ok = g < GROUP
        tl.store(part_m_ptr + row, m, mask=g_ok)
        tl.store(part_l_ptr + row, l, mask=g_ok)
        tl.store(part_acc_ptr + row[:, None] * D_PAD + d[None, :], acc, mask=g_ok[:, None])


@triton.jit
def _reduce_kernel(
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, num_splits,
    stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, S_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    s_ok = s < num_splits
    row = (seq * NUM_HEADS + head) * num_splits + s
    m = tl.load(part_m_ptr + row, mask=s_ok, other=float("-inf"))
    l = tl.load(part_l_ptr + row, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)  # finite: split 0 is never empty (seq_len >= 1)
    w = tl.exp2(m - m_max)  # empty partitions (m = -inf) weigh 0
    acc = tl.load(part_acc_ptr + row[:, None] * D_PAD + d[None, :], mask=s_ok[:, None],
                  other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + d,
             out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@triton.jit
def _prefill_kernel(
    q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr, out_ptr,
    scale_log2, window, first_seq, num_prefills,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_c_kv, stride_c_block, stride_c_slot, stride_c_h, stride_bt,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # rows of the tile: BLOCK_M = BLOCK_Q query tokens x G_PAD heads, token-major
    kvh = tl.program_id(1)
    qsl = query_start_ptr + first_seq
    target = tl.program_id(0) + tl.load(qsl) // BLOCK_Q
    # Find the last prefill j whose first tile query_start_loc[j] // BLOCK_Q + j <= target.
    lo = 0
    hi = num_prefills
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(qsl + mid) // BLOCK_Q + mid <= target:
            lo = mid + 1
        else:
            hi = mid
    j = lo - 1
    seq = (first_seq + j).to(tl.int64)
    q_start = tl.load(qsl + j)
    q_len = (tl.load(qsl + j + 1) - q_start).to(tl.int32)
    q0 = (target - (q_start // BLOCK_Q + j)).to(tl.int32) * BLOCK_Q
    ctx = tl.load(seq_lens_ptr + seq).to(tl.int32) - q_len  # cached tokens before the new ones

    r = tl.arange(0, BLOCK_M)
    qi = q0 + r // G_PAD
    gi = r % G_PAD
    heads = kvh * GROUP + gi
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    row_ok = (qi < q_len) & (gi < GROUP)
    io_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + (q_start + qi)[:, None] * stride_qt + heads[:, None] * stride_qh
                + d[None, :], mask=io_mask, other=0.0)
    q_pos = ctx + qi

    kv_hi = ctx + tl.minimum(q0 + BLOCK_Q, q_len)  # one past the tile's last query position
    kv_lo = 0
    if USE_WINDOW:
        kv_lo = tl.maximum(ctx + q0 - window + 1, 0)
    kv_hi = tl.where(q0 < q_len, kv_hi, kv_lo)  # a spare program past the sequence: no work

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    for tile in range(kv_lo, kv_hi, TILE_N):
        n = tile + tl.arange(0, TILE_N)
        n_ok = n < kv_hi
        block = tl.load(table + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        off = block * stride_c_block + (n % BLOCK_SIZE) * stride_c_slot + kvh * stride_c_h
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(cache_ptr + off[:, None] + d[None, :], mask=kv_mask,
                    other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        allowed = n_ok[None, :] & (n[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            allowed = allowed & (n[None, :] > q_pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(cache_ptr + stride_c_kv + off[:, None] + d[None, :], mask=kv_mask,
                    other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out_ptr + (q_start + qi)[:, None] * stride_ot + heads[:, None] * stride_oh
             + d[None, :], out.to(out_ptr.dtype.element_ty), mask=io_mask)


class TritonAttention:
    """The Triton paged-attention backend.

    Args:
        partition_size: context tokens per decode split (rounded up to the key tile), the
            same for every step so that a row's split never depends on the batch (see the
            module docstring).
        prefill_rows: rows of a prefill tile (query tokens x padded GQA group), a power
            of two.
    """

    name = "triton"

    def __init__(self, partition_size: int = PARTITION_SIZE, prefill_rows: int = 64) -> None:
        if partition_size < 1:
            raise ValueError(f"partition_size must be >= 1; got {partition_size}")
        if prefill_rows < 1 or prefill_rows & (prefill_rows - 1):
            raise ValueError(f"prefill_rows must be a power of two; got {prefill_rows}")
        self.partition_size = partition_size
        self.prefill_rows = prefill_rows

    # -- KV write -------------------------------------------------------------------------

    def write_kv(self, key, value, kv_cache, meta: AttentionMetadata) -> None:
        num_tokens, num_kv_heads, head_dim = key.shape
        if num_tokens == 0:
            return
        key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
        _check_cache(kv_cache, meta.block_size)
        _write_kv_kernel[(num_tokens,)](
            key, value, kv_cache, meta.slot_mapping,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            kv_cache.stride(0), kv_cache.stride(2), kv_cache.stride(3),
            NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
            H_PAD=_next_pow2(num_kv_heads), D_PAD=_next_pow2(head_dim),
        )

    # -- attention ------------------------------------------------------------------------

    def forward(self, query, kv_cache, meta: AttentionMetadata, scale, sliding_window=None):
        query = _last_dim_contiguous(query)
        _check_cache(kv_cache, meta.block_size)
        num_heads, head_dim = query.shape[1], query.shape[2]
        num_kv_heads = kv_cache.shape[3]
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        if kv_cache.shape[4] != head_dim:
            raise ValueError(f"query head_dim {head_dim} != cache head_dim {kv_cache.shape[4]}")
        out = torch.empty_like(query)
        group = num_heads // num_kv_heads
        common = {
            "scale_log2": float(scale) * _LOG2E,
            "window": int(sliding_window or 0),
            "stride_c_kv": kv_cache.stride(0), "stride_c_block": kv_cache.stride(1),
            "stride_c_slot": kv_cache.stride(2), "stride_c_h": kv_cache.stride(3),
            "stride_bt": meta.block_tables.stride(0),
            "GROUP": group, "G_PAD": max(_next_pow2(group), _MIN_DOT_ROWS),
            "HEAD_DIM": head_dim, "D_PAD": max(_next_pow2(head_dim), 16),
            "BLOCK_SIZE": meta.block_size,
            "USE_WINDOW": sliding_window is not None,
            "DOT_PRECISION": "ieee" if query.dtype == torch.float32 else "tf32",
        }
        nd = meta.num_decodes
        if nd:
            self._decode(query, kv_cache, meta, out, sliding_window, common)
        if meta.num_seqs > nd:
            self._prefill(query, kv_cache, meta, out, common)
        return out

    def _decode(self, query, kv_cache, meta, out, sliding_window, common) -> None:
        nd = meta.num_decodes
        num_heads, num_kv_heads = query.shape[1], kv_cache.shape[3]
        tile_n = max(16, _next_pow2(min(meta.block_size, 64)))
        longest = meta.max_decode_seq_len or max(meta.seq_lens_list[:nd])
        if sliding_window is not None:
            longest = min(longest, sliding_window)
        part = _cdiv(self.partition_size, tile_n) * tile_n
        splits = _cdiv(longest, part)
        d_pad = common["D_PAD"]
        if splits > 1:
            part_acc = torch.empty(nd, num_heads, splits, d_pad, dtype=torch.float32,
                                   device=query.device)
            part_m = torch.empty(nd, num_heads, splits, dtype=torch.float32, device=query.device)
            part_l = torch.empty_like(part_m)
        else:
            part_acc = part_m = part_l = out  # unused
        _decode_kernel[(nd, num_kv_heads, splits)](
            query, kv_cache, meta.block_tables, meta.seq_lens,
            out, part_acc, part_m, part_l,
            partition_size=part, num_splits=splits,
            stride_qt=query.stride(0), stride_qh=query.stride(1),
            stride_ot=out.stride(0), stride_oh=out.stride(1),
            NUM_HEADS=num_heads, SINGLE_SPLIT=splits == 1, TILE_N=tile_n,
            num_warps=4, **common,
        )
        if splits > 1:
            _reduce_kernel[(nd, num_heads)](
                out, part_acc, part_m, part_l, splits, out.stride(0), out.stride(1),
                NUM_HEADS=num_heads, S_PAD=_next_pow2(splits),
                HEAD_DIM=common["HEAD_DIM"], D_PAD=d_pad, num_warps=4,
            )

    def _prefill(self, query, kv_cache, meta, out, common) -> None:
        nd, num_seqs = meta.num_decodes, meta.num_seqs
        num_kv_heads = kv_cache.shape[3]
        block_q = max(1, self.prefill_rows // common["G_PAD"])
        num_prefill_tokens = sum(meta.query_lens_list[nd:])
        # Tile j of the prefills starts at query_start_loc[j] // block_q + j (see module
        # docstring); this many programs cover the last one. Spare ones exit at once.
        grid = (num_prefill_tokens // block_q + (num_seqs - nd) + 1, num_kv_heads)
        tile_n = 64 if query.device.type == "cuda" else 32
        _prefill_kernel[grid](
            query, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, out,
            first_seq=nd, num_prefills=num_seqs - nd,
            stride_qt=query.stride(0), stride_qh=query.stride(1),
            stride_ot=out.stride(0), stride_oh=out.stride(1),
            BLOCK_Q=block_q, BLOCK_M=block_q * common["G_PAD"], TILE_N=tile_n, num_warps=4,
            **common,
        )


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_cache(kv_cache: torch.Tensor, block_size: int) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[2] != block_size:
        raise ValueError(f"kv_cache must be [2, num_blocks, {block_size}, kv_heads, head_dim]; "
                         f"got {tuple(kv_cache.shape)}")
    if kv_cache.stride(4) != 1 or kv_cache.stride(1) != block_size * kv_cache.stride(2):
        raise ValueError("kv_cache blocks must be contiguous in their last three dimensions")


def decode_attention_bytes(seq_lens: list[int], num_kv_heads: int, head_dim: int,
                           element_size: int, sliding_window: int | None = None) -> int:
    """Bytes of K and V one decode attention call must read from memory (for bandwidth
    figures): ``2 * sum(context) * kv_heads * head_dim * element_size``."""
    tokens = sum(min(n, sliding_window) if sliding_window else n for n in seq_lens)
    return 2 * tokens * num_kv_heads * head_dim * element_size


__all__ = ["INTERPRET", "TritonAttention", "decode_attention_bytes"]
