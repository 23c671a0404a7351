"""Structured outputs on xgrammar: a request's output is constrained to a JSON schema, a
regex, a list of choices or an EBNF grammar.

::

    add_request ── grammar_from_spec (parse; bad spec -> ValueError) ── GrammarCache
                                                                         (compile in a
    RequestGrammar (one matcher per sequence) <── Future[CompiledGrammar] ─ worker thread)
      │ fill_bitmask(row)   every step, for the sampled rows that have one
      ▼
    GrammarBitmask [Bc, ceil(V/32)] int32 ──> Sampler: logits of those rows -> -inf
      │                                       where the bit is 0
    advance(token)  once per appended token (the engine, after the scheduler appended it)

A matcher's state is always the request's output tokens: it advances exactly once per
token appended, so preemption and recompute (which replay the same tokens through the
model but append nothing) leave it as it is.

xgrammar (~0.5 s to import) is imported only by ``grammar.py`` and ``request_grammar.py``,
which load with the first constrained request; an engine that never sees one never loads it.
"""

from pagedserve.structured_output.bitmask import GrammarBitmask, apply_grammar_bitmask
from pagedserve.structured_output.manager import StructuredOutputManager

__all__ = ["GrammarBitmask", "StructuredOutputManager", "apply_grammar_bitmask"]
