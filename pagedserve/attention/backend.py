"""The attention interface the model code calls, and the metadata of one step.

A step's batch is flat: the new tokens of every scheduled sequence, concatenated with no
padding. For sequence ``i`` the new tokens are rows
``query_start_loc[i]:query_start_loc[i+1]`` of ``q``; they sit at positions
``seq_lens[i] - query_len_i ... seq_lens[i] - 1`` of that sequence, whose earlier K/V
are already in the cache blocks listed in ``block_tables[i]``.

Worked example (block_size 4): sequence 0 decodes its 7th token (6 cached), sequence 1
prefills 3 prompt tokens::

    query_start_loc = [0, 1, 4]
    seq_lens        = [7, 3]
    block_tables    = [[5, 2], [0, 0]]      (padded with block 0, never read)
    slot_mapping    = [2*4+2, 0*4+0, 0*4+1, 0*4+2] = [10, 0, 1, 2]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    """Index tensors of one step (all on the model's device, int64 unless noted).

    Attributes:
        slot_mapping: ``[num_tokens]`` cache slot (block_id * block_size + offset) of
            each new token.
        query_start_loc: ``[num_seqs + 1]`` start of each sequence's new tokens in q.
        seq_lens: ``[num_seqs]`` context length of each sequence after this step (tokens).
        block_tables: ``[num_seqs, max_blocks]`` physical block ids, padded with 0; only
            the first ``cdiv(seq_lens[i], block_size)`` entries of row i are read.
        query_lens_list, seq_lens_list: the same lengths as Python ints, for loops and
            shape decisions without a device sync.
        num_decodes: the first ``num_decodes`` sequences have exactly one new token.
        block_size: tokens per block.
        max_decode_seq_len: an upper bound on the decodes' ``seq_lens`` that fixes the
            decode kernels' launch shape whatever the actual lengths (CUDA graphs replay
            one captured shape); None: the shape follows this batch's longest decode.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    query_lens_list: list[int]
    seq_lens_list: list[int]
    num_decodes: int
    block_size: int
    max_decode_seq_len: int | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)


class AttentionBackend(Protocol):
    """Writes new K/V into the paged cache and attends over the cached context."""

    name: str

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        """Store ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` at
        ``meta.slot_mapping`` in ``kv_cache`` ``[2, num_blocks, block_size, num_kv_heads,
        head_dim]``."""

    def forward(
        self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
        scale: float, sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Causal attention of ``query`` ``[num_tokens, num_heads, head_dim]`` over each
        sequence's cached context; returns ``[num_tokens, num_heads, head_dim]``.

        ``num_heads`` must be a multiple of ``num_kv_heads`` (grouped-query attention).
        A ``sliding_window`` w lets a query at position p see keys at positions > p - w.
        """
