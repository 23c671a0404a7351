"""Tool calling in chat: ``tools`` + ``tool_choice`` -> a constraint on the output, and the
output -> ``message.tool_calls`` (whole, or as OpenAI's streamed deltas).

=====================  ===========================================  ====================
``tool_choice``        output                                       ``finish_reason``
=====================  ===========================================  ====================
named function         constrained to its ``parameters`` schema;    ``stop`` (as OpenAI
                       the text is the call's ``arguments``         for a forced call)
``"required"``         constrained to a JSON list of                ``tool_calls``
                       ``{"name", "parameters"}`` of the tools
                       (one item unless ``parallel_tool_calls``)
``"auto"``             free; calls parsed from the text by the      ``tool_calls`` if it
                       server's ``--tool-call-parser``              called one
``"none"``             free text                                    as the engine says
=====================  ===========================================  ====================

Sources: OpenAI's "Function calling" guide and chat API reference; vLLM's rules (tools
with no ``tool_choice`` mean ``auto``, which needs ``--enable-auto-tool-choice``) and its
``required`` schema.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pagedserve.entrypoints.openai.errors import APIError
from pagedserve.entrypoints.openai.protocol_chat import (
    ChatCompletionRequest,
    FunctionCall,
    NamedToolChoice,
    ToolCall,
)
from pagedserve.entrypoints.openai.tool_parsers import (
    HermesStream,
    ParsedCall,
    hermes_extract,
)

_EMPTY_OBJECT = {"type": "object", "properties": {}}


@dataclass
class ToolMode:
    """How a chat request uses its tools: ``kind`` is None (no tools, or ``"none"``),
    ``"named"`` (``name`` forced), ``"required"`` or ``"auto"``."""

    kind: str | None = None
    name: str | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)  # as the chat template takes them


def tool_mode(req: ChatCompletionRequest, auto_enabled: bool) -> ToolMode:
    """Resolve ``tools`` / ``tool_choice`` (vLLM's rules). Raises ``APIError`` 400 naming
    ``tool_choice`` when it names an unknown function, comes without ``tools``, or is
    ``auto`` (also the default with ``tools``) on a server without
    ``--enable-auto-tool-choice``."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    choice = req.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return ToolMode()
    if choice is None:
        choice = "auto"
    if choice == "none":
        return ToolMode(tools=tools)
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in {t["function"]["name"] for t in tools}:
            raise APIError(400, f"tool_choice names the function {name!r}, which is not in "
                                "tools", param="tool_choice")
        return ToolMode("named", name, tools)
    if choice == "auto" and not auto_enabled:
        raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and '
                            "--tool-call-parser to be set", param="tool_choice")
    return ToolMode(choice, None, tools)


def tool_schema(mode: ToolMode, parallel: bool) -> dict | None:
    """The JSON schema the output must follow for a named or ``required`` tool choice,
    else None."""
    if mode.kind == "named":
        (fn,) = [t["function"] for t in mode.tools if t["function"]["name"] == mode.name]
        schema = fn.get("parameters") or _EMPTY_OBJECT
    elif mode.kind == "required":
        schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                            "parameters": t["function"].get("parameters") or _EMPTY_OBJECT},
             "required": ["name", "parameters"]}
            for t in mode.tools]}}
        if not parallel:
            schema["maxItems"] = 1
    else:
        return None
    return schema


def _tool_call(call: ParsedCall) -> ToolCall:
    return ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))


def _required_calls(text: str) -> list[ParsedCall]:
    """The calls of a ``required`` output (a JSON list), or [] if it is not complete."""
    try:
        items = json.loads(text)
    except ValueError:
        return []
    return [ParsedCall(i["name"], json.dumps(i["parameters"], ensure_ascii=False))
            for i in items]


def parse_output(mode: ToolMode, text: str, finish_reason: str | None
                 ) -> tuple[str | None, list[ToolCall] | None, str | None]:
    """``(content, tool_calls, finish_reason)`` of a finished choice's text."""
    if mode.kind == "named":
        if finish_reason != "stop":  # cut by max_tokens: the arguments are not complete JSON
            return text, None, finish_reason
        return None, [_tool_call(ParsedCall(mode.name, text))], finish_reason
    if mode.kind == "required":
        calls = _required_calls(text) if finish_reason == "stop" else []
    elif mode.kind == "auto":
        content, calls = hermes_extract(text)
        if calls:
            return content, [_tool_call(c) for c in calls], _called(finish_reason)
        return text, None, finish_reason
    else:
        return text, None, finish_reason
    if not calls:
        return text, None, finish_reason
    return None, [_tool_call(c) for c in calls], _called(finish_reason)


def _called(finish_reason: str | None) -> str | None:
    return "tool_calls" if finish_reason == "stop" else finish_reason


class DeltaStream:
    """One choice's ``delta`` dicts as its text grows (OpenAI's streaming of tool calls:
    a call's first delta has ``index``, ``id``, ``type``, ``function.name`` and
    ``function.arguments`` ``""``; later ones only ``index`` and ``function.arguments``)."""

    def __init__(self, mode: ToolMode) -> None:
        self.mode = mode
        self._text = ""
        self._num_calls = 0
        self._hermes = HermesStream() if mode.kind == "auto" else None

    def feed(self, delta: str) -> list[dict]:
        """Deltas for new text ``delta`` (possibly none)."""
        if self.mode.kind == "named":
            out = [] if self._num_calls else self._start(ParsedCall(self.mode.name, ""))
            return out + ([self._args(0, delta)] if delta else [])
        if self.mode.kind == "required":
            self._text += delta  # sent whole once the list is complete
            return []
        if self._hermes is not None:
            return self._hermes_deltas(*self._hermes.feed(delta))
        return [{"content": delta}] if delta else []

    def finish(self, finish_reason: str | None) -> tuple[list[dict], str | None]:
        """The last deltas and the choice's ``finish_reason``."""
        if self.mode.kind == "named":
            return [], finish_reason
        if self.mode.kind == "required":
            calls = _required_calls(self._text) if finish_reason == "stop" else []
            if not calls:
                return ([{"content": self._text}] if self._text else []), finish_reason
            return [d for c in calls for d in self._start(c)], _called(finish_reason)
        if self._hermes is not None:
            deltas = self._hermes_deltas(*self._hermes.finish())
            return deltas, _called(finish_reason) if self._num_calls else finish_reason
        return [], finish_reason

    def _hermes_deltas(self, content: str, calls: list[ParsedCall]) -> list[dict]:
        out = [{"content": content}] if content else []
        for call in calls:
            out += self._start(call)
        return out

    def _start(self, call: ParsedCall) -> list[dict]:
        index = self._num_calls
        self._num_calls += 1
        first = {"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                 "function": {"name": call.name, "arguments": ""}}]}
        return [first] + ([self._args(index, call.arguments)] if call.arguments else [])

    @staticmethod
    def _args(index: int, text: str) -> dict:
        return {"tool_calls": [{"index": index, "function": {"arguments": text}}]}
