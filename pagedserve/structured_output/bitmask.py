"""The token bitmask of one step's constrained rows, and applying it to logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GrammarBitmask:
    """Allowed next tokens of the constrained rows of a sampling batch.

    Attributes:
        rows: [Bc] int64, the rows of the batch that are constrained (ascending).
        bitmask: [Bc, ceil(V / 32)] int32; bit ``t % 32`` of word ``t // 32`` of row ``i``
            set = token ``t`` allowed for ``rows[i]`` (xgrammar's layout).
        stop_only: per constrained row, True when only stop tokens are allowed (the grammar
            is complete): ``min_tokens`` must not mask them then, or nothing would be left.
    """

    rows: torch.Tensor
    bitmask: torch.Tensor
    stop_only: list[bool]


def bitmask_width(vocab_size: int) -> int:
    """Words (int32) per bitmask row: ``ceil(vocab_size / 32)``."""
    return -(-vocab_size // 32)


def bit_value(i: int) -> int:
    """The int32 value with only bit ``i`` (0..31) set; bit 31 is the sign bit."""
    return -(1 << 31) if i == 31 else 1 << i


def apply_grammar_bitmask(logits: torch.Tensor, mask: GrammarBitmask) -> None:
    """Set ``logits[rows[i], t]`` to -inf for every token ``t`` not allowed by row ``i`` of
    the bitmask, in place; ``logits`` is [B, V] float32, other rows are untouched.

    Uses xgrammar's kernel (a C++ loop on CPU, a CUDA kernel on GPU). Raises
    ``ValueError`` if the bitmask is narrower than ``ceil(V / 32)`` words."""
    import xgrammar as xgr  # loaded with the first constrained request, not with the sampler

    vocab = logits.shape[1]
    if mask.bitmask.shape[1] * 32 < vocab:
        raise ValueError(f"bitmask covers {mask.bitmask.shape[1] * 32} tokens; logits have {vocab}")
    bitmask = mask.bitmask.to(logits.device, non_blocking=True)
    if mask.rows.numel() == logits.shape[0]:  # every row constrained: no gather
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab)
        return
    rows = mask.rows.to(logits.device)
    sub = logits[rows]
    xgr.apply_token_bitmask_inplace(sub, bitmask, vocab_size=vocab)
    logits[rows] = sub
