"""Request models of the OpenAI API (pagedserve/entrypoints/openai/protocol*.py) without a
server: unknown fields are accepted and named in a DEBUG log line, as vLLM's."""

import logging

import pytest

from pagedserve.entrypoints.openai.protocol_chat import (
    AssistantMessage,
    ChatCompletionRequest,
    UserMessage,
)
from pagedserve.entrypoints.openai.protocol_completion import CompletionRequest

LOGGER = "pagedserve.entrypoints.openai.protocol"
IGNORED = "The following fields were present in the request but ignored: "


def ignored_lines(caplog) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records
            if r.name == LOGGER and r.getMessage().startswith(IGNORED)]


def test_unknown_fields_are_accepted_and_logged_at_debug(caplog):
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        req = CompletionRequest.model_validate(
            {"prompt": "x", "some_future_field": {"x": 1}, "best_of_n": 2})
    assert req.prompt == "x" and req.model_extra == {"some_future_field": {"x": 1},
                                                     "best_of_n": 2}
    assert ignored_lines(caplog) == [
        (logging.DEBUG, IGNORED + "['best_of_n', 'some_future_field']")]


def test_nested_unknown_fields_are_named_and_known_ones_are_silent(caplog):
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "hi", "extra_key": 1}], "max_tokens": 2})
        assert ignored_lines(caplog) == [(logging.DEBUG, IGNORED + "['extra_key']")]
        caplog.clear()
        CompletionRequest.model_validate({"prompt": "x", "max_tokens": 2, "seed": 2**64 - 1})
    assert ignored_lines(caplog) == []


def test_not_logged_above_debug(caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        CompletionRequest.model_validate({"prompt": "x", "some_future_field": 1})
    assert ignored_lines(caplog) == []


def test_messages_are_chosen_by_role():
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant"}]})
    assert [type(m) for m in req.messages] == [UserMessage, AssistantMessage]
    assert req.messages[1].content is None
    with pytest.raises(ValueError, match="content"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": None}]})
