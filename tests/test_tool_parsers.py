"""Tool calling without a model: the hermes parser (whole and streamed), the tool_choice
rules, and the constraint and deltas of named / required choices (issue 14)."""

from __future__ import annotations

import json

import pytest

from pagedserve.entrypoints.openai.errors import APIError
from pagedserve.entrypoints.openai.protocol_chat import ChatCompletionRequest
from pagedserve.entrypoints.openai.request_params import request_constraint
from pagedserve.entrypoints.openai.tool_parsers import HermesStream, hermes_extract
from pagedserve.entrypoints.openai.tools import DeltaStream, parse_output, tool_mode, tool_schema

CALL = '{"name": "f", "arguments": {"a": [1, "</x>"]}}'
TEXTS = [
    "plain text, no call",
    f"<tool_call>\n{CALL}\n</tool_call>",
    f"Sure: <tool><tool_call>{CALL}</tool_call>\n<tool_call>{CALL}</tool_call> after",
    f"<tool_call>{CALL}",  # unclosed at the end: still a call (as vLLM)
    "ends with a partial <tool_ca",
    "<tool_call>not json</tool_call>",
]


@pytest.mark.parametrize("text", TEXTS)
def test_hermes_stream_equals_whole_parse_at_every_split(text):
    content, calls = hermes_extract(text)
    for size in (1, 2, 5, len(text)):
        stream = HermesStream()
        got_content, got_calls = "", []
        for i in range(0, len(text), size):
            c, k = stream.feed(text[i:i + size])
            got_content += c
            got_calls += k
        c, k = stream.finish()
        assert (got_content + c or None, [(x.name, x.arguments) for x in got_calls + k]) == \
            (content, [(x.name, x.arguments) for x in calls])


def test_hermes_extract_values():
    content, calls = hermes_extract(TEXTS[2])
    assert content == "Sure: <tool>"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": [1, "</x>"]})] * 2
    assert len({c.id for c in calls}) == 2
    assert hermes_extract(TEXTS[5]) == (TEXTS[5], [])


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}},
         {"type": "function", "function": {"name": "g"}}]


def _req(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], **kw})


@pytest.mark.parametrize(("kw", "auto", "message"), [
    ({"tools": TOOLS}, False, "--enable-auto-tool-choice"),  # tools alone mean "auto"
    ({"tools": TOOLS, "tool_choice": "auto"}, False, "--enable-auto-tool-choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "h"}}}, True,
     "'h'"),
    ({"tool_choice": "required"}, True, "needs tools"),
])
def test_tool_choice_rules(kw, auto, message):
    with pytest.raises(APIError, match=message) as err:
        tool_mode(_req(**kw), auto)
    assert (err.value.status, err.value.param) == (400, "tool_choice")


def test_named_and_required_constraints_and_outputs():
    named = tool_mode(_req(tools=TOOLS, tool_choice={"type": "function",
                                                     "function": {"name": "f"}}), False)
    assert tool_schema(named, True) == TOOLS[0]["function"]["parameters"]
    content, calls, finish = parse_output(named, '{"a": 1}', "stop")
    assert (content, calls[0].function.name, calls[0].function.arguments, finish) == \
        (None, "f", '{"a": 1}', "stop")
    assert parse_output(named, '{"a": ', "length") == ('{"a": ', None, "length")

    required = tool_mode(_req(tools=TOOLS, tool_choice="required"), False)
    schema = tool_schema(required, False)
    assert (schema["minItems"], schema["maxItems"]) == (1, 1)
    assert "maxItems" not in tool_schema(required, True)
    text = '[{"name": "g", "parameters": {}}, {"name": "f", "parameters": {"a": 2}}]'
    content, calls, finish = parse_output(required, text, "stop")
    assert [(c.function.name, c.function.arguments) for c in calls] == \
        [("g", "{}"), ("f", '{"a": 2}')]
    assert (content, finish) == (None, "tool_calls")
    with pytest.raises(APIError, match=r"\['tool_choice', 'response_format'\]"):
        request_constraint(_req(response_format={"type": "json_object"}),
                           tool_schema(required, True))


def test_named_deltas_stream_the_arguments():
    named = tool_mode(_req(tools=TOOLS, tool_choice={"type": "function",
                                                     "function": {"name": "f"}}), False)
    stream = DeltaStream(named)
    deltas = stream.feed('{"a"') + stream.feed(": 1}")
    last, finish = stream.finish("stop")
    first = deltas[0]["tool_calls"][0]
    assert (first["index"], first["type"], first["function"]) == \
        (0, "function", {"name": "f", "arguments": ""})
    assert first["id"].startswith("chatcmpl-tool-")
    args = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas[1:])
    assert (args, last, finish) == ('{"a": 1}', [], "stop")
    assert all(set(d["tool_calls"][0]) == {"index", "function"} for d in deltas[1:])


def test_serve_flags_parse_and_are_documented():
    from pagedserve.args import EngineArgs
    from pagedserve.entrypoints.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["serve", "--structured-outputs-config.backend", "xgrammar",
                              "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.structured_outputs_config == {"backend": "xgrammar"}
    assert engine_args.structured_outputs_backend == "xgrammar"
    assert (args.enable_auto_tool_choice, args.tool_call_parser) == (True, "hermes")
    serve_help = parser._subparsers._group_actions[0].choices["serve"].format_help()
    for flag in ("--structured-outputs-config.backend", "--chat-template",
                 "--enable-auto-tool-choice", "--tool-call-parser"):
        assert flag in serve_help
    with pytest.raises(ValueError, match="unknown keys"):
        _ = EngineArgs(structured_outputs_config={"backnd": "x"}).structured_outputs_backend


def test_chat_template_flag_reads_a_file_or_takes_the_text(tmp_path):
    from pagedserve.entrypoints.openai.api_server import load_chat_template

    path = tmp_path / "t.jinja"
    path.write_text("{{ messages }}")
    assert load_chat_template(str(path)) == "{{ messages }}"
    assert load_chat_template("{% for m in messages %}{% endfor %}").startswith("{%")
    with pytest.raises(ValueError, match="--chat-template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
