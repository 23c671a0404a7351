"""Tool-call parsers: find the function calls in a model's text (``tool_choice: "auto"``).

``hermes`` (vLLM's name; Hermes 2 Pro, Qwen2.5, Qwen3 and other models whose chat templates
render ``tools`` in this style): each call is a JSON object
``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``. As vLLM's
``Hermes2ProToolParser``: the message content is the text before the first call, and a
block that is not such an object leaves the whole text as content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

TOOL_PARSERS = ("hermes",)
START, END = "<tool_call>", "</tool_call>"
# A closed block, or an unclosed one at the end (the output was cut or ended without it).
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


@dataclass
class ParsedCall:
    """One function call: ``arguments`` is a JSON string (OpenAI's wire format)."""

    name: str
    arguments: str
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or tool_call_id()


def tool_call_id() -> str:
    """``chatcmpl-tool-<32 hex digits>``, vLLM's tool call ids."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _parse_call(block: str) -> ParsedCall | None:
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ParsedCall(obj["name"], args if isinstance(args, str)
                      else json.dumps(args, ensure_ascii=False))


def hermes_extract(text: str) -> tuple[str | None, list[ParsedCall]]:
    """``(content, calls)`` of a complete output; content is None when empty."""
    if START not in text:
        return text, []
    calls = []
    for match in _BLOCK.finditer(text):
        call = _parse_call(match.group(1) if match.group(1) is not None else match.group(2))
        if call is None:
            return text, []
        calls.append(call)
    content = text[: text.index(START)]
    return content or None, calls


class HermesStream:
    """The same parse, fed with text deltas: content is released as soon as it cannot be
    the start of ``<tool_call>``, each call as soon as its block closes.

    ``feed`` and ``finish`` return ``(content delta, completed calls)``. The content and
    calls streamed equal ``hermes_extract`` of the whole text, except that a stream cannot
    take back content already sent when a later block turns out malformed (that block is
    then sent as content)."""

    def __init__(self) -> None:
        self._buf = ""
        self._inside = False
        self._seen_call = False

    def feed(self, delta: str) -> tuple[str, list[ParsedCall]]:
        self._buf += delta
        content, calls = "", []
        while True:
            if self._inside:
                end = self._buf.find(END)
                if end < 0:
                    return content, calls
                call = _parse_call(self._buf[:end])
                if call is None:
                    content += START + self._buf[: end + len(END)]
                else:
                    calls.append(call)
                self._buf = self._buf[end + len(END):]
                self._inside = False
                continue
            start = self._buf.find(START)
            if start >= 0:
                content += self._visible(self._buf[:start])
                self._buf = self._buf[start + len(START):]
                self._inside = self._seen_call = True
                continue
            keep = _partial_suffix(self._buf, START)
            content += self._visible(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return content, calls

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """Flush at the end of the output: an unclosed block is a call if it parses."""
        buf, self._buf = self._buf, ""
        if not self._inside:
            return self._visible(buf), []
        self._inside = False
        call = _parse_call(buf)
        return ("", [call]) if call is not None else (START + buf, [])

    def _visible(self, text: str) -> str:
        """Text outside blocks is content only before the first call (as vLLM)."""
        return "" if self._seen_call else text


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
