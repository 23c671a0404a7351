"""The engine's side of structured outputs: a grammar per request, the step's bitmask, and
advancing the matchers by the sampled tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagedserve.request import Request
from pagedserve.sampling_params import SamplingParams
from pagedserve.structured_output.bitmask import GrammarBitmask, bit_value, bitmask_width

if TYPE_CHECKING:
    from pagedserve.structured_output.grammar import GrammarCache
    from pagedserve.structured_output.request_grammar import RequestGrammar

# vLLM's --structured-outputs-config.backend values; "auto" and "xgrammar" are xgrammar.
BACKENDS = ("auto", "xgrammar")


class StructuredOutputManager:
    """Owns the grammar cache; the engine calls it at three points of a request's life.

    Args:
        tokenizer: the engine's Hugging Face tokenizer (None: constrained requests are
            rejected).
        vocab_size: the model's padded vocabulary size V (the logits' width).
        stop_token_ids: EOS and the model's extra EOS ids; a complete grammar allows them.
        backend: ``auto`` or ``xgrammar``.

    Raises:
        ValueError: an unknown backend.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int],
                 backend: str = "auto") -> None:
        if backend not in BACKENDS:
            raise ValueError(f"structured_outputs_config.backend must be one of {BACKENDS}; "
                             f"got {backend!r}")
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.tokenizer = tokenizer
        self.cache: GrammarCache | None = None  # made with the first constrained request

    def request_grammars(self, params: SamplingParams, n: int) -> list[RequestGrammar | None]:
        """One grammar state per sample of a request (all None when unconstrained); the
        grammar's compilation starts now, on a worker thread.

        Raises ``ValueError`` naming the ``structured_outputs`` field for a spec that does
        not parse, or when the engine has no tokenizer."""
        spec = params.structured_outputs
        if spec is None:
            return [None] * n
        if self.tokenizer is None:
            raise ValueError("structured_outputs needs a tokenizer (skip_tokenizer_init=True "
                             "given)")
        from pagedserve.structured_output.grammar import GrammarCache
        from pagedserve.structured_output.request_grammar import RequestGrammar

        if self.cache is None:
            self.cache = GrammarCache(self.tokenizer, self.vocab_size, self.stop_token_ids)
        compiled = self.cache.get(spec)
        return [RequestGrammar(compiled, self.stop_token_ids) for _ in range(n)]

    def grammar_bitmask(self, rows: list[tuple[Request, list[int]]]) -> GrammarBitmask | None:
        """The bitmask of the rows that have a grammar (row i samples ``rows[i][0]``'s next
        token after its draft tokens ``rows[i][1]``), or None when none has:
        unconstrained batches pay nothing."""
        constrained = [i for i, (r, _) in enumerate(rows) if r.grammar is not None]
        if not constrained:
            return None
        bitmask = torch.full((len(constrained), bitmask_width(self.vocab_size)), -1,
                             dtype=torch.int32)
        stop_only = []
        for j, i in enumerate(constrained):
            request, drafts = rows[i]
            request.grammar.fill_bitmask(bitmask, j, drafts)
            # Only where min_tokens is still masking stop tokens does it matter.
            num_output = request.num_output_tokens + len(drafts)
            active = num_output < request.sampling_params.min_tokens
            stop_only.append(active and self._only_stop_tokens(bitmask[j]))
        return GrammarBitmask(torch.tensor(constrained, dtype=torch.int64), bitmask, stop_only)

    def _only_stop_tokens(self, row: torch.Tensor) -> bool:
        """True if ``row`` (one bitmask row) allows no token but stop tokens."""
        rest = row.clone()
        for t in self.stop_token_ids:
            rest[t // 32] &= ~bit_value(t % 32)
        return not bool(rest.any())

    @staticmethod
    def advance(requests: list[Request], sampled: dict[str, list[int]]) -> None:
        """Advance the grammar of each request by the tokens it got this step (after the
        scheduler appended them). Raises ``RuntimeError`` on a token the grammar rejects."""
        for r in requests:
            tokens = sampled.get(r.request_id, ())
            if r.grammar is not None:
                first = r.num_output_tokens - len(tokens) + 1
                for i, token in enumerate(tokens):
                    r.grammar.accept(token, first + i)

    def shutdown(self) -> None:
        if self.cache is not None:
            self.cache.shutdown()
