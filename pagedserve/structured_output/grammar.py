"""From a ``StructuredOutputsParams`` to an xgrammar grammar, and a cache of compiled ones.

Parsing a spec into an ``xgrammar.Grammar`` is quick and is where bad input shows up (an
invalid schema, a regex or EBNF that does not parse): ``grammar_from_spec`` does it on the
caller's thread so the error reaches that request alone. Compiling (the per-token mask
tables over the vocabulary) is the slow part: ``GrammarCache`` runs it on a worker thread
and shares the result between all requests with the same spec.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
from collections import OrderedDict

import xgrammar as xgr

from pagedserve.sampling_params import StructuredOutputsParams

# A JSON object of any shape (vLLM compiles json_object the same way).
_ANY_OBJECT = '{"type": "object"}'
# Most whitespace characters between two JSON tokens (xgrammar's max_whitespace_cnt) when
# whitespace is free: llama.cpp's JSON grammars allow as much ("\n"{1,2} [ \t]{0,20}, "to
# prevent the model running away"), room for indentation 5 levels deep. Unbounded, small
# models fill the output with whitespace until max_tokens.
MAX_WHITESPACE = 22
# Without free whitespace: json.dumps' compact separators, no whitespace outside strings.
_COMPACT = (",", ":")
# xgrammar's error text is its C++ log line: "[01:22:35] /project/cpp/file.cc:5082: reason".
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def spec_key(spec: StructuredOutputsParams) -> tuple[str, str, bool]:
    """``(kind, text, disable_any_whitespace)``: equal for equal constraints (a schema
    dict and its JSON text give the same key; key order is kept: it is the order in which
    the grammar emits properties).
    Raises ``ValueError`` for a ``json`` string that is not JSON."""
    (kind,) = spec.kinds()
    value = getattr(spec, kind)
    if kind == "json":
        try:
            value = json.loads(value) if isinstance(value, str) else value
        except json.JSONDecodeError as err:
            raise ValueError(f"structured_outputs.json is not valid JSON: {err}") from err
        text = json.dumps(value)
    elif kind == "choice":
        text = json.dumps(value)
    elif kind == "json_object":
        text = _ANY_OBJECT
    else:
        text = value
    return kind, text, spec.disable_any_whitespace


def _ebnf_literal(text: str) -> str:
    """``text`` as an EBNF string literal (JSON escapes are xgrammar's EBNF escapes)."""
    return json.dumps(text, ensure_ascii=False)


def xgrammar_reason(err: RuntimeError) -> str:
    """The reason in an xgrammar error, without its log line's time and source position:
    ``Unsupported type "nonsense"``."""
    lines = str(err).strip().splitlines()
    return _LOG_PREFIX.sub("", lines[-1]) if lines else repr(err)


def grammar_from_spec(spec: StructuredOutputsParams) -> xgr.Grammar:
    """Parse ``spec`` into an ``xgrammar.Grammar`` (no tokenizer needed; milliseconds).

    A JSON schema (``json``, ``json_object``) allows at most ``MAX_WHITESPACE`` whitespace
    characters between two JSON tokens; with ``disable_any_whitespace`` none at all outside
    strings (separators ``,`` and ``:``, as ``json.dumps(..., separators=(",", ":"))``).

    Raises:
        ValueError: ``structured_outputs.<kind> cannot be compiled: <xgrammar's reason>``
            for a schema that is not valid JSON or that xgrammar cannot convert, a regex or
            EBNF grammar that does not parse, or an empty choice string.
    """
    kind, text, no_ws = spec_key(spec)
    try:
        if kind in ("json", "json_object"):
            if no_ws:
                return xgr.Grammar.from_json_schema(text, any_whitespace=False,
                                                    separators=_COMPACT)
            return xgr.Grammar.from_json_schema(text, max_whitespace_cnt=MAX_WHITESPACE)
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        if kind == "choice":
            if "" in spec.choice:
                raise ValueError("structured_outputs.choice must not contain an empty string")
            return xgr.Grammar.from_ebnf(
                "root ::= " + " | ".join(_ebnf_literal(c) for c in spec.choice))
        return xgr.Grammar.from_ebnf(text)
    except RuntimeError as err:  # xgrammar reports every parse failure as RuntimeError
        raise ValueError(f"structured_outputs.{kind} cannot be compiled: "
                         f"{xgrammar_reason(err)}") from err


class GrammarCache:
    """Compiled grammars keyed by ``spec_key``; compiled on a worker thread, at most
    ``max_entries`` kept (least recently used dropped).

    Args:
        tokenizer: the engine's Hugging Face tokenizer.
        vocab_size: the model's (padded) vocabulary size, the width of its logits.
        stop_token_ids: the ids that end a sequence (EOS and the model's extra EOS ids):
            a grammar that is complete allows exactly these.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int],
                 max_entries: int = 256) -> None:
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._tokenizer = tokenizer
        self._compiler: xgr.GrammarCompiler | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="pagedserve-grammar")
        self._entries: OrderedDict[tuple, concurrent.futures.Future] = OrderedDict()
        self._max_entries = max_entries

    def _get_compiler(self) -> xgr.GrammarCompiler:
        """Built on first use (on the worker thread): reading the vocabulary takes ~0.2 s."""
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(
                self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
            # Our own cache does the caching; xgrammar's would keep a second copy.
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def get(self, spec: StructuredOutputsParams) -> concurrent.futures.Future:
        """A future of the ``xgrammar.CompiledGrammar`` of ``spec`` (done at once when
        cached). Raises ``ValueError`` as ``grammar_from_spec`` for a bad spec."""
        key = spec_key(spec)
        future = self._entries.get(key)
        if future is not None:
            self._entries.move_to_end(key)
            return future
        grammar = grammar_from_spec(spec)
        future = self._executor.submit(lambda: self._get_compiler().compile_grammar(grammar))
        self._entries[key] = future
        if len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)
        return future

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
