"""One sequence's grammar state: its own xgrammar matcher over a shared compiled grammar."""

from __future__ import annotations

import concurrent.futures

import torch
import xgrammar as xgr

from pagedserve.structured_output.bitmask import bit_value


class RequestGrammar:
    """The matcher of one sequence (each of a request's ``n`` samples has its own).

    The matcher is made on first use from the compiled grammar (waiting for its
    compilation if it is still running, which overlaps the prompt's prefill). Its state
    is the sequence's output tokens: ``accept`` is called once per token appended, and
    ``num_accepted`` counts them so that a second advance by the same token is caught.
    """

    def __init__(self, compiled: concurrent.futures.Future, stop_token_ids: list[int]) -> None:
        self._compiled = compiled
        self._matcher: xgr.GrammarMatcher | None = None
        self.stop_token_ids = list(stop_token_ids)
        self.num_accepted = 0

    @property
    def matcher(self) -> xgr.GrammarMatcher:
        if self._matcher is None:
            self._matcher = xgr.GrammarMatcher(self._compiled.result())
        return self._matcher

    @property
    def is_terminated(self) -> bool:
        """True once a stop token was accepted (the grammar is complete)."""
        return self._matcher is not None and self._matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int, drafts: list[int] = ()) -> None:
        """Write the tokens allowed next into ``bitmask[row]`` (bit ``t % 32`` of word
        ``t // 32`` set = token ``t`` allowed); with ``drafts``, those allowed after them
        (speculative decoding: the matcher takes them, then rolls back). After the stop
        token (a request with ``ignore_eos`` or ``min_tokens`` goes on), only the stop
        tokens stay allowed: the output remains what the grammar accepted, and no row is
        left with nothing. Where the grammar rejects a draft, the row gets the mask after
        the drafts before it: verification never reaches such a row (its draft cannot be
        sampled), so its tokens are never used."""
        taken = 0
        for token in drafts:
            if self.is_terminated or not self.matcher.accept_token(token):
                break
            taken += 1
        if self.is_terminated:
            bitmask[row] = 0
            for t in self.stop_token_ids:
                bitmask[row, t // 32] |= bit_value(t % 32)
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)
        if taken:
            self.matcher.rollback(taken)

    def accept(self, token_id: int, num_output_tokens: int) -> None:
        """Advance by the sequence's newest token, its ``num_output_tokens``-th.

        Raises ``RuntimeError`` if the matcher already saw that token (advanced twice) or
        rejects it (the mask was not applied): both are engine bugs."""
        if num_output_tokens != self.num_accepted + 1:
            raise RuntimeError(f"grammar advanced out of step: {self.num_accepted} tokens "
                               f"accepted, output token {num_output_tokens} given")
        self.num_accepted += 1
        if self.is_terminated:
            return  # a stop token after the end (ignore_eos): the grammar stays complete
        if not self.matcher.accept_token(token_id):
            raise RuntimeError(f"token {token_id} is not allowed by the request's grammar")

