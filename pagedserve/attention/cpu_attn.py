"""Paged attention on CPU through a C++ kernel (``csrc/paged_attention_cpu.cpp``).

The kernel reads each sequence's K/V straight from its blocks, so a decode step costs
no gathered copy of the context. It handles any query length (tests check prefill rows
too); the backend routes only decodes to it. See ``cpu_ops.py`` for how it is built.
"""

from __future__ import annotations

import torch

from pagedserve.attention.backend import AttentionMetadata
from pagedserve.attention.torch_attn import TorchAttention
from pagedserve.cpu_ops import load_cpu_ops


class CpuAttention(TorchAttention):
    """The C++ kernel for decodes (6x faster than gather + SDPA at batch 64 here) and for
    writing K/V into the cache; prefills keep PyTorch's fused attention, which is faster
    for long query blocks."""

    name = "cpu"

    def __init__(self) -> None:
        self.ops = load_cpu_ops()

    def write_kv(self, key, value, kv_cache, meta: AttentionMetadata) -> None:
        self.ops.reshape_and_cache(key, value, kv_cache, meta.slot_mapping)

    def forward(self, query, kv_cache, meta: AttentionMetadata, scale, sliding_window=None):
        out = torch.empty_like(query)
        nd = meta.num_decodes
        if nd:
            self.ops.paged_attention(
                query[:nd].contiguous(), kv_cache, meta.block_tables[:nd], meta.seq_lens[:nd],
                meta.query_start_loc[: nd + 1], out[:nd], scale, sliding_window or 0)
        self._prefill(query, kv_cache, meta, scale, sliding_window, out)
        return out
