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

This module holds what the endpoints share: the base model, the error body, the sampling
fields of completions and chat, and ``/v1/models``. Each endpoint's own bodies are in
``protocol_completion``, ``protocol_chat`` and ``protocol_tokenize``.
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



# -- LoRA adapters at runtime (vLLM's endpoints) ----------------------------------------


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    """``POST /v1/load_lora_adapter``: a PEFT adapter directory (``lora_path``, on the
    server's file system) to serve under ``lora_name`` (what requests put in ``model``)."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"lora_name": "sql-lora", "lora_path": "/adapters/sql-lora"}]})

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    """``POST /v1/unload_lora_adapter``: the adapter to stop serving, by name
    (``lora_int_id`` is accepted as vLLM's, and ignored)."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"lora_name": "sql-lora"}]})

    lora_name: str
    lora_int_id: int | None = None
