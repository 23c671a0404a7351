"""Request and response bodies of the OpenAI API, as pydantic models.

Sources: the OpenAI API reference (Completions, Chat Completions, Models, error objects) and
vLLM's ``vllm/entrypoints/openai/protocol.py`` for the extras (``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``skip_special_tokens``, ``include_stop_str_in_output``; ``/tokenize`` and ``/detokenize``).

Request models validate types strictly (``"0.5"`` is not a number, ``1`` is not a bool), as
OpenAI does; unknown fields are accepted and ignored, as vLLM does, and their names are
logged at DEBUG level. Response models are serialized with every field present (``null``
where OpenAI sends ``null``).

The server's OpenAPI document (``/openapi.json``) is generated from these same models, so
what it publishes is what they accept; the request models carry ``examples`` that the
server accepts as they are.
"""

from __future__ import annotations

import logging
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

logger = logging.getLogger(__name__)

# Any int torch.Generator.manual_seed takes.
Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]
TokenId = Annotated[int, Field(ge=0)]
# Logprobs are clamped here so that -inf never reaches JSON (vLLM does the same).
MIN_LOGPROB = -9999.0


class OpenAIBaseModel(BaseModel):
    """Strict types; unknown fields allowed, ignored, and their names logged at DEBUG
    level (vLLM's ``OpenAIBaseModel`` logs them too; a warning per request would flood the
    log of a server whose clients send fields of other APIs)."""

    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="after")
    def _log_ignored_fields(self):
        if self.model_extra:
            logger.debug("The following fields were present in the request but ignored: %s",
                         sorted(self.model_extra))
        return self


# -- errors ---------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    """The ``error`` object of OpenAI's error responses."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


# -- shared pieces --------------------------------------------------------------------


class StreamOptions(OpenAIBaseModel):
    """``stream_options``: ``include_usage`` adds a final chunk with the usage."""

    include_usage: bool | None = False


class UsageInfo(BaseModel):
    """Token counts of a request: prompt tokens (each prompt once) and generated tokens."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class JsonSchemaFormat(OpenAIBaseModel):
    """``response_format.json_schema``: OpenAI's ``{name, description, schema, strict}``."""

    name: str
    description: str | None = None
    # "schema" shadows a pydantic BaseModel attribute: stored as json_schema, sent as schema.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    """``response_format``: ``text`` (no constraint), ``json_object`` (any JSON object) or
    ``json_schema`` (JSON that validates against ``json_schema.schema``)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(OpenAIBaseModel):
    """vLLM's ``structured_outputs`` object: exactly one of ``json`` (a schema), ``regex``,
    ``choice``, ``grammar`` (EBNF), ``json_object``; ``disable_any_whitespace`` drops free
    whitespace from JSON."""

    # "json" shadows a pydantic BaseModel method: stored as json_, sent as json.
    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class SamplingFields(OpenAIBaseModel):
    """Sampling fields shared by completions and chat (OpenAI's, then vLLM's extras).

    Constraints (at most one): ``response_format``, ``structured_outputs`` and vLLM's older
    ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``."""

    model: str | None = None
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    n: Annotated[int, Field(ge=1, le=128)] | None = 1
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = 0
    ignore_eos: bool | None = False
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    # -1: the last max_model_len tokens; 0 is rejected by SamplingParams, naming the field.
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


# -- completions ----------------------------------------------------------------------


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


# -- chat -----------------------------------------------------------------------------


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


# -- models ---------------------------------------------------------------------------


class ModelCard(BaseModel):
    """One entry of ``GET /v1/models`` (OpenAI's model object plus vLLM's extras)."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedserve"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    """``GET /v1/models``: the served model."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- vLLM's tokenizer endpoints -------------------------------------------------------


class TokenizeCompletionRequest(OpenAIBaseModel):
    """``POST /tokenize`` with a text prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(OpenAIBaseModel):
    """``POST /tokenize`` with chat messages (the chat template is applied)."""

    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class TokenizeResponse(BaseModel):
    """``/tokenize`` result: token ids, their count, and the server's max_model_len."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    """``POST /detokenize``: token ids back to text."""

    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    """``/detokenize`` result: the decoded text."""

    prompt: str
