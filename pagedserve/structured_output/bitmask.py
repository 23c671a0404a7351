"""The token bitmask of one step's constrained rows, and applying it to logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.cpu_ops import cpu_layer_ops


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

    On CPU our kernel (``csrc/token_bitmask_cpu.cpp``: the same cost whatever the grammar
    allows, every thread); elsewhere, or without the C++ kernels, xgrammar's (a CUDA
    kernel; on CPU a loop whose cost grows with the disallowed tokens, ~15 ms for 64
    restrictive rows). Raises ``ValueError`` if the bitmask is narrower than
    ``ceil(V / 32)`` words."""
    vocab = logits.shape[1]
    if mask.bitmask.shape[1] * 32 < vocab:
        raise ValueError(f"bitmask covers {mask.bitmask.shape[1] * 32} tokens; logits have {vocab}")
    ops = cpu_layer_ops(logits)
    if ops is not None and logits.dtype == torch.float32:
        ops.apply_token_bitmask_(logits, mask.bitmask, mask.rows)
        return
    import xgrammar as xgr  # loaded with the first constrained request, not with the sampler

    bitmask = mask.bitmask.to(logits.device, non_blocking=True)
    if mask.rows.numel() == logits.shape[0]:  # every row constrained: no gather
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab)
        return
    rows = mask.rows.to(logits.device)
    sub = logits[rows]
    xgr.apply_token_bitmask_inplace(sub, bitmask, vocab_size=vocab)
    logits[rows] = sub
