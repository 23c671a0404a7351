"""Speculative decoding's figures in a benchmark's report: drafts, acceptance rate and the
acceptance by draft position, over the benchmark's timed part."""

from __future__ import annotations

from pagedserve.metrics import SpecDecodingStats


def spec_decode_report(start: SpecDecodingStats | None, end: SpecDecodingStats | None
                       ) -> dict | None:
    """What the engine's cumulative counters gained from ``start`` to ``end``
    (``LLMEngine.spec_decoding_stats()`` snapshots); None without speculation.

    ``acceptance_rate`` = accepted / verified draft tokens; ``mean_acceptance_length`` =
    tokens a verifying request gains per step (its accepted drafts plus the one token
    sampled after them), vLLM's figure."""
    if end is None:
        return None
    gained = end - (start or SpecDecodingStats(end.num_spec_tokens))
    drafts = gained.num_drafts
    return {
        "num_drafts": drafts,
        "num_draft_tokens": gained.num_draft_tokens,
        "num_accepted_tokens": gained.num_accepted_tokens,
        "acceptance_rate": gained.acceptance_rate,
        "mean_acceptance_length": 1 + gained.num_accepted_tokens / drafts if drafts else None,
        "acceptance_rate_per_pos": [n / drafts if drafts else None
                                    for n in gained.num_accepted_tokens_per_pos],
    }


def print_spec_decode_report(r: dict | None) -> None:
    """The report's lines (nothing without speculation)."""
    if r is None:
        return
    if not r["num_drafts"]:
        print("Speculative decoding: no drafts verified")
        return
    per_pos = ", ".join(f"{x:.2f}" for x in r["acceptance_rate_per_pos"])
    print(f"Speculative decoding: {r['num_drafts']} drafts, {r['num_draft_tokens']} draft "
          f"tokens, acceptance rate {r['acceptance_rate']:.3f}, mean acceptance length "
          f"{r['mean_acceptance_length']:.2f}; per position {per_pos}")
