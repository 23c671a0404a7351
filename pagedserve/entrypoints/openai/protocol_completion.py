"""Bodies of ``POST /v1/completions`` (OpenAI's legacy completions, with vLLM's
``prompt_logprobs``); the sampling fields are ``protocol.SamplingFields``."""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedserve.entrypoints.openai.protocol import SamplingFields, TokenId, UsageInfo


class CompletionRequest(SamplingFields):
    """``POST /v1/completions`` (OpenAI's legacy completions).

    ``prompt``: a string, a list of strings, a list of token ids, or a list of token-id
    lists; each prompt gives ``n`` choices, numbered prompt-major. ``max_tokens: 0`` is
    allowed only with ``echo`` (score the prompt, generate nothing; vLLM's rule).
    ``prompt_logprobs`` (vLLM extra): top-N logprobs of every prompt token, returned per
    choice; not with ``stream``.
    """

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0},
        {"prompt": [[504, 3575, 282], [1206, 1112]], "max_tokens": 4, "n": 2, "seed": 7,
         "logprobs": 2, "stop": ["\n"]},
    ]})

    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    best_of: Annotated[int, Field(ge=1)] | None = None
    echo: bool | None = False
    logprobs: Annotated[int, Field(ge=0)] | None = None
    max_tokens: Annotated[int, Field(ge=0)] | None = 16
    suffix: str | None = None
    # vLLM extras
    prompt_logprobs: Annotated[int, Field(ge=0)] | None = None


class CompletionLogProbs(BaseModel):
    """Legacy logprobs: parallel lists per token; ``text_offset`` is the character offset
    of each token in the choice's text; ``top_logprobs`` maps token text -> logprob."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseStreamChoice(BaseModel):
    """One choice of a streamed completion chunk: index ``prompt * n + sample``;
    ``stop_reason`` (vLLM) is the stop string or token id that ended it."""

    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class PromptLogprob(BaseModel):
    """vLLM's ``Logprob`` as its server sends it: natural-log probability, 1-based rank in
    the model's distribution, token text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionResponseChoice(CompletionResponseStreamChoice):
    """One choice of a non-streamed completion; ``prompt_logprobs`` (vLLM extra, when
    asked): one entry per prompt token, None for the first, else token id -> logprob of the
    prompt's token and the top-N (JSON keys are the ids as strings)."""

    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None


class CompletionResponse(BaseModel):
    """A ``text_completion`` object (non-streamed ``/v1/completions``)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(BaseModel):
    """One streamed ``text_completion`` chunk; ``usage`` only in the last chunk, and only
    when ``stream_options.include_usage`` (``null`` in the others)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None
