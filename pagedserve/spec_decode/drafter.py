"""What proposes draft tokens (``Drafter``), how many a request may take, and the n-gram
drafter. The model drafters (``self``, ``draft_model``) run a model, so they live with the
worker (``worker/draft_runner.py``).

A drafter proposes at the end of a step, for the requests that sampled in it; the next
step verifies the drafts (``rejection.py``). Drafts are proposed without looking at a
request's structured-output grammar: each verification row is masked by the grammar's
state after the drafts before it, so a draft the grammar rejects is never accepted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from pagedserve.request import Request
from pagedserve.spec_decode.ngram import NgramProposer

if TYPE_CHECKING:
    from pagedserve.config import SpeculativeConfig


class Drafter(Protocol):
    model: torch.nn.Module | None  # the draft model, if any (its weights count as the engine's)

    def after_forward(self, runner, step: tuple) -> None:
        """Called after every forward pass of the target (``step``: its inputs)."""

    def propose(self, runner, step: tuple, requests: list[Request],
                sampled: dict[str, list[int]], block_tables: dict[str, list[int]]
                ) -> dict[str, list[int]]:
        """Draft tokens to follow each of ``requests`` once its ``sampled`` tokens are
        appended. ``runner`` is the target's ``ModelRunner``, ``step`` the step's forward
        inputs ``(input_ids, positions, attention metadata)`` and ``block_tables`` the
        requests' block tables, lookahead slots included."""

    def draft_probs(self, request_id: str, num_drafts: int) -> torch.Tensor | None:
        """``[num_drafts, V]``: the distributions the request's pending drafts were sampled
        from, or None when they were not sampled (then verification is one-hot)."""


def max_drafts(request: Request, num_new: int, k: int, max_model_len: int) -> int:
    """How many drafts ``request`` may verify next step once its ``num_new`` tokens of this
    step are appended: at most ``k``, and with the bonus token it must stay within
    ``max_tokens`` and ``max_model_len``."""
    num_tokens = request.num_tokens + num_new
    num_output = request.num_output_tokens + num_new
    return max(0, min(k, max_model_len - num_tokens - 1,
                      request.sampling_params.max_tokens - num_output - 1))


class NgramDrafter:
    """vLLM's ``ngram`` method: drafts copied from the request's own prompt and output
    (``NgramProposer``); no model, no KV, one-hot drafts."""

    model = None

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.proposer = NgramProposer(self.k, config.prompt_lookup_min,
                                      config.prompt_lookup_max, max_model_len)

    def after_forward(self, runner, step) -> None:
        pass

    def propose(self, runner, step, requests, sampled, block_tables) -> dict[str, list[int]]:
        drafts = {}
        for r in requests:
            new = sampled[r.request_id]
            limit = max_drafts(r, len(new), self.k, self.max_model_len)
            if limit > 0:
                tokens = self.proposer.propose(r.all_token_ids + new)[:limit]
                if tokens:
                    drafts[r.request_id] = tokens
        return drafts

    def draft_probs(self, request_id: str, num_drafts: int) -> None:
        return None
