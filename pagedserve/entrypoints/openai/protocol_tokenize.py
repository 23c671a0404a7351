"""Bodies of vLLM's tokenizer endpoints, ``POST /tokenize`` and ``POST /detokenize``."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from pagedserve.entrypoints.openai.protocol import OpenAIBaseModel, TokenId
from pagedserve.entrypoints.openai.protocol_chat import ChatMessage


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
