"""Bodies of ``POST /v1/chat/completions``: the conversation's messages (a union chosen by
``role``), tools and ``tool_choice``, the request, and ``chat.completion`` objects and
chunks; the sampling fields are ``protocol.SamplingFields``."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedserve.entrypoints.openai.protocol import OpenAIBaseModel, SamplingFields, UsageInfo


class ContentPart(OpenAIBaseModel):
    """One part of a message's content; only ``{"type": "text", "text": ...}`` is served."""

    type: str
    text: str | None = None


MessageContent = str | list[ContentPart]


class SystemMessage(OpenAIBaseModel):
    """A system (or ``developer``) message; ``content`` is required."""

    role: Literal["system", "developer"]
    content: MessageContent
    name: str | None = None


class UserMessage(OpenAIBaseModel):
    """A user message; ``content`` is required."""

    role: Literal["user"]
    content: MessageContent
    name: str | None = None


class FunctionCall(OpenAIBaseModel):
    """A function call: its name and its arguments as a JSON string."""

    name: str
    arguments: str


class ToolCall(OpenAIBaseModel):
    """One entry of ``tool_calls``: ``{"id", "type": "function", "function"}``."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(OpenAIBaseModel):
    """An assistant message: the only role whose ``content`` may be omitted or null
    (OpenAI's rule, for turns that carry only tool calls)."""

    role: Literal["assistant"]
    content: MessageContent | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None


class ToolMessage(OpenAIBaseModel):
    """A tool result; ``content`` is required; ``tool_call_id`` names the call answered."""

    role: Literal["tool"]
    content: MessageContent
    name: str | None = None
    tool_call_id: str | None = None


class FunctionDefinition(OpenAIBaseModel):
    """A tool's function: ``name``, ``description``, ``parameters`` (a JSON schema)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(OpenAIBaseModel):
    """One entry of ``tools``: ``{"type": "function", "function": {...}}``."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    """``tool_choice`` forcing one function: ``{"type": "function", "function": {"name"}}``."""

    type: Literal["function"] = "function"
    function: NamedFunction


# A conversation message, chosen by ``role`` (a discriminated union: the OpenAPI document
# publishes which roles require ``content``, as OpenAI's reference does); ``content`` is a
# string or a list of text parts.
ChatMessage = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage,
                        Field(discriminator="role")]
MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``. The prompt is the model's chat template applied to
    ``messages`` with the generation prompt. ``max_completion_tokens`` wins over the older
    ``max_tokens``; None means up to ``max_model_len``. ``echo`` (vLLM extra): when the last
    message is the assistant's, its content starts the reply."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"messages": [{"role": "user", "content": "What is the capital of France?"}],
         "max_completion_tokens": 16, "temperature": 0},
        {"messages": [{"role": "system", "content": "You answer in one word."},
                      {"role": "user", "content": [{"type": "text", "text": "Name a color."}]},
                      {"role": "assistant", "content": None},
                      {"role": "user", "content": "Another one?"}],
         "max_tokens": 8, "seed": 7, "stream": True, "stream_options": {"include_usage": True}},
    ]})

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    # vLLM extras
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    echo: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None


class ChatMessageResponse(BaseModel):
    """The assistant message of a chat choice; ``content`` is null when it only calls
    tools, ``tool_calls`` null when it calls none."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None


class TopLogprob(BaseModel):
    """An alternative token: text, natural-log probability, UTF-8 bytes."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProb(BaseModel):
    """A generated token with its logprob and its ``top_logprobs`` alternatives."""

    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatCompletionLogProbs(BaseModel):
    """Chat ``logprobs``: one entry per generated token in ``content``."""

    content: list[ChatCompletionLogProb] | None = None
    refusal: list[ChatCompletionLogProb] | None = None


class ChatCompletionResponseChoice(BaseModel):
    """One choice of a ``chat.completion``."""

    index: int
    message: ChatMessageResponse
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    """A ``chat.completion`` object (non-streamed ``/v1/chat/completions``)."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class ChatCompletionStreamChoice(BaseModel):
    """``delta`` holds only the keys that changed (``role`` first, then ``content`` or
    ``tool_calls``: ``[{"index", "id", "type", "function": {"name", "arguments"}}]`` on a
    call's first delta, ``[{"index", "function": {"arguments"}}]`` after, as OpenAI)."""

    index: int
    delta: dict[str, Any]
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None


class ChatCompletionStreamResponse(BaseModel):
    """One ``chat.completion.chunk``; ``usage`` as in ``CompletionStreamResponse``."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
