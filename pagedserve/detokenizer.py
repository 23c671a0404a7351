"""Incremental (streaming) detokenization and stop-string detection for one sequence.

Follows vLLM v1 (``vllm/v1/engine/detokenizer.py``): fast tokenizers decode with the
tokenizers library's ``DecodeStream`` (vLLM's ``FastIncrementalDetokenizer``); any other
tokenizer with a ``decode(ids, skip_special_tokens=...)`` method uses the prefix/read
offset window (vLLM's ``detokenize_incrementally``). Both cost O(new tokens) per step, never
re-decode the whole output, and never emit half of a multi-byte UTF-8 character: text that
ends in U+FFFD is held back until a later token completes it.
"""

from __future__ import annotations

import logging

from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

try:
    import tokenizers
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover - tokenizers is a dependency
    tokenizers = None
    DecodeStream = None

_REPLACEMENT = "\ufffd"
_INVALID_PREFIX = "Invalid prefix encountered"


def _prompt_suffix(decode, prompt_ids: list[int]) -> list[int]:
    """A short prompt suffix (4..23 tokens) that decodes without U+FFFD, as vLLM primes."""
    for i in range(4, min(len(prompt_ids) + 1, 24)):
        if _REPLACEMENT not in decode(prompt_ids[-i:]):
            return prompt_ids[-i:]
    return prompt_ids[-4:] if len(prompt_ids) > 4 else list(prompt_ids)


class _StreamDecoder:
    """``tokenizers.decoders.DecodeStream`` over the backend ``tokenizers.Tokenizer``."""

    def __init__(self, backend, prompt_ids: list[int], params: SamplingParams) -> None:
        self.backend = backend
        self.skip = params.skip_special_tokens
        self.stream = DecodeStream(skip_special_tokens=self.skip)
        self.added: dict[int, str] = {}
        self.last_added = False
        for tid in _prompt_suffix(lambda ids: backend.decode(ids, skip_special_tokens=self.skip),
                                  prompt_ids):
            self.step(tid)
        # vLLM: without spaces between special tokens, an added token that follows another
        # is emitted as its raw content (some decoders prefix it with a space).
        if not (self.skip or params.spaces_between_special_tokens):
            self.added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}

    def step(self, token_id: int) -> str:
        try:
            text = self.stream.step(self.backend, token_id)
        except (OverflowError, TypeError):
            logger.warning("invalid token id %r skipped by the detokenizer", token_id)
            text = None
        except Exception as e:  # tokenizers raises a plain Exception
            if not str(e).startswith(_INVALID_PREFIX):
                raise
            # DecodeStream's state breaks on non-monotonic decodes (vLLM issue 17448).
            self.stream = DecodeStream(skip_special_tokens=self.skip)
            text = self.stream.step(self.backend, token_id)
        if self.added:
            content = self.added.get(token_id)
            if content is not None and self.last_added:
                text = content
            self.last_added = content is not None
        return text or ""


class _WindowDecoder:
    """vLLM's prefix_offset / read_offset method over any ``tokenizer.decode``.

    ``ids[prefix:read]`` is text already emitted that gives context (leading spaces,
    merges); ``decode(ids[prefix:]) - decode(ids[prefix:read])`` is the new text.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.kwargs = {"skip_special_tokens": params.skip_special_tokens}
        if not params.spaces_between_special_tokens:
            self.kwargs["spaces_between_special_tokens"] = False
        self.ids = _prompt_suffix(self._decode, list(prompt_ids))
        self.prefix = max(len(self.ids) - 5, 0)
        self.read = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, **self.kwargs) if ids else ""

    def step(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix:self.read])
        new_text = self._decode(self.ids[self.prefix:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""  # incomplete character (or nothing new yet): wait for more tokens
        delta = new_text[len(prefix_text):]
        del self.ids[: self.read]  # keep the window short: context = ids since last emit
        self.prefix, self.read = 0, len(self.ids)
        return delta


def _make_decoder(tokenizer, prompt_ids: list[int], params: SamplingParams):
    backend = tokenizer if tokenizers and isinstance(tokenizer, tokenizers.Tokenizer) else getattr(
        tokenizer, "_tokenizer", None)
    if DecodeStream is not None and tokenizers and isinstance(backend, tokenizers.Tokenizer):
        return _StreamDecoder(backend, prompt_ids, params)
    return _WindowDecoder(tokenizer, prompt_ids, params)


class IncrementalDetokenizer:
    """Output text of one sequence, built token by token, with stop-string handling.

    Args:
        tokenizer: a transformers tokenizer, a ``tokenizers.Tokenizer``, or None (no text).
        prompt_token_ids: the prompt; its last tokens give the decoder context so the first
            output token gets the same leading space as in a full decode.
        params: ``detokenize``, ``skip_special_tokens``, ``spaces_between_special_tokens``,
            ``stop``, ``include_stop_str_in_output`` and ``min_tokens`` are used.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.params = params
        self.output_token_ids: list[int] = []
        self._text = ""
        self._last_offset = 0
        self.stop_string: str | None = None
        self.stop = list(params.stop or [])
        self.decoder = None
        if tokenizer is not None and params.detokenize:
            self.decoder = _make_decoder(tokenizer, list(prompt_token_ids), params)
        # Characters held back while streaming, so a partial stop string is never sent.
        hold = self.stop and not params.include_stop_str_in_output
        self.stop_buffer_length = max(len(s) for s in self.stop) - 1 if hold else 0

    @property
    def output_text(self) -> str:
        """The full output text so far (cut at the stop string once one is found)."""
        return self._text

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Append ``new_token_ids``; return the stop string now found in the text, else None.

        The search covers text that spans token boundaries. When found, the text is cut
        before the stop string (right after it with ``include_stop_str_in_output``).
        ``stop_terminated`` (vLLM): the last token is EOS / a stop token id; its text is not
        added unless ``include_stop_str_in_output``. Stop strings are not searched in the
        text of the first ``min_tokens`` tokens (vLLM). After a stop string, further
        tokens add no text.
        """
        if not new_token_ids:
            return None
        skip_last = stop_terminated and not self.params.include_stop_str_in_output
        check_from = len(self._text)
        for i, tid in enumerate(new_token_ids):
            self.output_token_ids.append(tid)
            if self.decoder is None or self.stop_string is not None:
                continue
            if not (skip_last and i == len(new_token_ids) - 1):
                self._text += self.decoder.step(tid)
            if len(self.output_token_ids) <= self.params.min_tokens:
                check_from = len(self._text)
        if not self.stop or self.stop_string is not None:
            return None
        if len(self.output_token_ids) <= self.params.min_tokens or check_from == len(self._text):
            return None
        return self._check_stop(check_from)

    def _check_stop(self, check_from: int) -> str | None:
        """Earliest stop string that ends after ``check_from``; cuts the text at it."""
        best: tuple[int, str] | None = None
        for s in self.stop:
            idx = self._text.find(s, max(0, check_from - len(s) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        self._text = self._text[: idx + len(s) if self.params.include_stop_str_in_output else idx]
        self.stop_string = s
        return s

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to send now (vLLM semantics).

        While not finished, the last ``max(len(stop)) - 1`` characters are held back (unless
        ``include_stop_str_in_output``), so a partial stop string is never streamed.
        ``delta=True`` returns only text not returned by an earlier ``delta=True`` call;
        ``delta=False`` returns all text that may be sent so far.
        """
        hold = 0 if finished else self.stop_buffer_length
        end = len(self._text) - hold
        if not delta:
            return self._text[:end] if hold else self._text
        if end <= self._last_offset:
            return ""
        start, self._last_offset = self._last_offset, end
        return self._text[start:end]
