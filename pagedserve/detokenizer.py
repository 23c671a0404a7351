"""Incremental (streaming) detokenization and stop-string detection for one sequence.

Follows vLLM v1 (``vllm/v1/engine/detokenizer.py``): fast tokenizers decode with the
tokenizers library's ``DecodeStream`` (vLLM's ``FastIncrementalDetokenizer``); any other
tokenizer with a ``decode(ids, skip_special_tokens=...)`` method uses the prefix/read
offset window (vLLM's ``detokenize_incrementally``). Both cost O(new tokens) per step, never
re-decode the whole output, and never emit half of a multi-byte UTF-8 character: text that
ends in U+FFFD is held back until a later token completes it.

Two rules go beyond vLLM, so that the text always equals what ``tokenizer.decode`` gives:

- When the request finishes, bytes still pending are flushed as ``decode`` renders them
  (U+FFFD for an incomplete trailing character).
- A prompt may end inside a character (token-id prompts). The output's text is then
  ``decode(prompt + output)`` minus its longest common prefix with ``decode(prompt)``: a
  character that the output's bytes complete belongs to the output, prompt text never does.
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


class _Decoder:
    """Token ids -> text pieces. Subclasses implement ``_next``.

    Both kinds keep ``ids``: ``ids[:read]`` are the tokens of the last emitted piece (context
    for ``decode``), ``ids[read:]`` the tokens whose text is still pending (an incomplete
    character). ``prompt_tail`` is the text of the prompt's own pending tokens.
    """

    def __init__(self, prompt_ids: list[int]) -> None:
        self.ids: list[int] = []
        self.read = 0
        for tid in _prompt_suffix(self.decode, prompt_ids):
            self.step(tid)
        self.prompt_tail = self._pending_text()

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def _next(self, token_id: int) -> str | None:
        """Text completed by ``token_id`` ("" if none yet); None if the id is invalid."""
        raise NotImplementedError

    def step(self, token_id: int) -> str:
        """Append one token; return the text it completes ("" while a character is open)."""
        text = self._next(token_id)
        if text is None:
            return ""
        self.ids.append(token_id)
        if text:
            del self.ids[: self.read]
            self.read = len(self.ids)
        return text

    def _pending_text(self) -> str:
        if self.read == len(self.ids):
            return ""
        return self.decode(self.ids)[len(self.decode(self.ids[: self.read])):]

    def flush(self) -> str:
        """The pending tokens' text as ``decode`` renders it (U+FFFD for an incomplete
        character); afterwards nothing is pending."""
        text = self._pending_text()
        self.read = len(self.ids)
        return text


class _StreamDecoder(_Decoder):
    """``tokenizers.decoders.DecodeStream`` over the backend ``tokenizers.Tokenizer``."""

    def __init__(self, backend, prompt_ids: list[int], params: SamplingParams) -> None:
        self.backend = backend
        self.skip = params.skip_special_tokens
        self.stream = DecodeStream(skip_special_tokens=self.skip)
        self.added: dict[int, str] = {}
        self.last_added = False
        super().__init__(prompt_ids)
        # vLLM: without spaces between special tokens, an added token that follows another
        # is emitted as its raw content (some decoders prefix it with a space).
        if not (self.skip or params.spaces_between_special_tokens):
            self.added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=self.skip)

    def _next(self, token_id: int) -> str | None:
        try:
            text = self.stream.step(self.backend, token_id)
        except (OverflowError, TypeError):
            logger.warning("invalid token id %r skipped by the detokenizer", token_id)
            return None
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


class _WindowDecoder(_Decoder):
    """vLLM's prefix_offset / read_offset method over any ``tokenizer.decode``:
    ``decode(ids) - decode(ids[:read])`` is the new text, emitted once it does not end in
    U+FFFD (the context tokens ``ids[:read]`` give leading spaces and merges)."""

    def __init__(self, tokenizer, prompt_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.kwargs = {"skip_special_tokens": params.skip_special_tokens}
        if not params.spaces_between_special_tokens:
            self.kwargs["spaces_between_special_tokens"] = False
        super().__init__(list(prompt_ids))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, **self.kwargs) if ids else ""

    def _next(self, token_id: int) -> str:
        ids = [*self.ids, token_id]
        prefix_text = self.decode(ids[: self.read])
        new_text = self.decode(ids)
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""  # incomplete character (or nothing new yet): wait for more tokens
        return new_text[len(prefix_text):]


def _make_decoder(tokenizer, prompt_ids: list[int], params: SamplingParams) -> _Decoder:
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

    Invariant: every text ``get_next_output_text`` returns (``delta=False``) is a prefix of
    every later one, and of the final text; so streamed deltas add up to the final text.
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
        # The prompt's own incomplete last character(s), and how much of it the output has
        # re-decoded identically (the longest common prefix rule, see the module docstring).
        self._prompt_tail = self.decoder.prompt_tail if self.decoder else ""
        self._overlap = 0
        self._matching = bool(self._prompt_tail)
        # Characters held back while streaming, so a partial stop string is never sent.
        hold = self.stop and not params.include_stop_str_in_output
        self.stop_buffer_length = max(len(s) for s in self.stop) - 1 if hold else 0

    @property
    def output_text(self) -> str:
        """The full output text so far (cut at the stop string once one is found)."""
        return self._text

    @property
    def prompt_text_trim(self) -> int:
        """Characters at the end of ``decode(prompt)`` that are not part of the common
        prefix of ``decode(prompt)`` and ``decode(prompt + output)``: U+FFFD of a prompt that
        ends inside a character which the output completed; 0 for a prompt that ends on a
        character boundary. Final once ``output_text`` is non-empty or the request ended."""
        return len(self._prompt_tail) - self._overlap

    def _add_text(self, text: str) -> None:
        """Append decoded text, minus what repeats the prompt's pending tail."""
        if self._matching:
            tail, i = self._prompt_tail, 0
            while (i < len(text) and self._overlap < len(tail)
                   and text[i] == tail[self._overlap]):
                i, self._overlap = i + 1, self._overlap + 1
            self._matching = i == len(text) and self._overlap < len(tail)
            text = text[i:]
        self._text += text

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
                self._add_text(self.decoder.step(tid))
            if len(self.output_token_ids) <= self.params.min_tokens:
                check_from = len(self._text)
        return self._check_stop(check_from)

    def finish(self) -> str | None:
        """The sequence ended without a stop string (length, EOS, stop token id): add the
        text of pending bytes as ``tokenizer.decode`` renders them (U+FFFD for an incomplete
        trailing character). Returns a stop string that this text completes, else None."""
        if self.decoder is None or self.stop_string is not None:
            return None
        check_from = len(self._text)
        self._add_text(self.decoder.flush())
        return self._check_stop(check_from)

    def _check_stop(self, check_from: int) -> str | None:
        """Earliest stop string that ends after ``check_from``; cuts the text at it."""
        if (not self.stop or self.stop_string is not None or check_from == len(self._text)
                or len(self.output_token_ids) <= self.params.min_tokens):
            return None
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
        ``include_stop_str_in_output``), so no text that may still become part of a stop
        string is sent: a stop string found later starts at or after the held-back part,
        so cutting the text there never removes text already sent.
        ``delta=True`` returns only text not returned by an earlier ``delta=True`` call;
        ``delta=False`` returns all text that may be sent so far.
        """
        hold = 0 if finished else self.stop_buffer_length
        end = max(len(self._text) - hold, 0)
        if not delta:
            return self._text[:end]
        if end <= self._last_offset:
            return ""
        start, self._last_offset = self._last_offset, end
        return self._text[start:end]
