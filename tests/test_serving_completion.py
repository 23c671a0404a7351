"""``/v1/completions`` hands the engine token ids, never text: tokenizing a long text on
the engine thread would stall every stream in flight (a 20 MB prompt took ~30 s there)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pagedserve.entrypoints.openai.errors import APIError
from pagedserve.entrypoints.openai.protocol_completion import CompletionRequest
from pagedserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedserve.entrypoints.openai.serving_engine import ServingContext


class _Added(Exception):
    """Stops the handler once the engine has been given its request."""


class RecordingEngine:
    """Stands in for ``AsyncLLM``: records what ``add_request`` gets, then stops."""

    def __init__(self) -> None:
        self.prompts: list = []

    async def add_request(self, request_id, prompt, params, arrival_time=None, lora_request=None):
        self.prompts.append(prompt)
        raise _Added


@pytest.fixture(scope="module")
def tok(llm):
    return llm.get_tokenizer()


def _complete(tok, prompt) -> tuple[RecordingEngine, BaseException]:
    engine = RecordingEngine()
    ctx = ServingContext(engine=engine, served_model_name="m", model_aliases={"m"},
                         model_root="m", tokenizer=tok, max_model_len=2048)
    handler = OpenAIServingCompletion(ctx)
    req = CompletionRequest(model="m", prompt=prompt, max_tokens=4)
    with pytest.raises((_Added, APIError)) as info:
        asyncio.run(handler.create_completion(req, raw=None))
    ctx.executor.shutdown()
    return engine, info.value


def test_text_prompt_reaches_the_engine_as_token_ids(tok):
    text = "The quick brown fox " * 500
    engine, _ = _complete(tok, text)
    assert engine.prompts == [{"prompt": text, "prompt_token_ids": tok.encode(text)}]


def test_tokenizing_runs_off_the_calling_thread(tok, monkeypatch):
    threads = []
    real = tok.encode

    def encode(text, **kwargs):
        threads.append(threading.current_thread().name)
        return real(text, **kwargs)

    monkeypatch.setattr(tok, "encode", encode)
    _complete(tok, ["a", "b"])
    assert len(threads) == 2
    assert all(name.startswith("pagedserve-tokenizer") for name in threads), threads


def test_invalid_text_in_a_batch_names_its_index(tok):
    engine, err = _complete(tok, ["fine", "bad \ud800"])
    assert isinstance(err, APIError) and err.status == 400
    assert err.param == "prompt[1]" and err.message.startswith("prompt[1]: ")
    assert engine.prompts == []  # nothing was queued
