"""What the completion and chat handlers share: the serving context (model names, tokenizer
calls off the event loop, the chat template), response ids and logprob clamping.

The request's parameters are turned into engine ones in ``request_params``; streams are
merged and framed as server-sent events in ``streaming``; errors are in ``errors``."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pagedserve.engine.async_engine import AsyncLLM
from pagedserve.entrypoints.openai.errors import APIError
from pagedserve.entrypoints.openai.protocol import MIN_LOGPROB
from pagedserve.entrypoints.openai.protocol_chat import ChatMessage
from pagedserve.lora.request import LoRARequest

T = TypeVar("T")


def random_id(prefix: str) -> str:
    """``{prefix}-<32 hex digits>`` (``cmpl``, ``chatcmpl``), as OpenAI and vLLM."""
    return f"{prefix}-{uuid.uuid4().hex}"


def clamp_logprob(value: float) -> float:
    """-inf and NaN are not JSON: clamp to -9999.0 as vLLM does."""
    return value if not math.isnan(value) and value > MIN_LOGPROB else MIN_LOGPROB


@dataclass
class ServingContext:
    """State the handlers share.

    Attributes:
        engine: the async engine.
        served_model_name: the name ``/v1/models`` lists and responses carry.
        model_aliases: every name a request may use for the model.
        model_root: the model path (``root`` in ``/v1/models``).
        tokenizer: the engine's Hugging Face tokenizer (read-only use; encoding and
            decoding do not mutate a fast tokenizer).
        max_model_len: longest sequence in tokens.
        executor: one thread for tokenizer work, so chat templating and ``/tokenize``
            never block the event loop.
        chat_template: ``--chat-template``'s template text, or None for the model's.
        enable_auto_tool_choice: ``--enable-auto-tool-choice`` (``tool_choice: "auto"``
            parses calls from the text with ``tool_call_parser``).
        lora_requests: the LoRA adapters served, by name (a request's ``model``); changed
            only by ``serving_models.LoRAAdapters``, on the event loop.
    """

    engine: AsyncLLM
    served_model_name: str
    model_aliases: set[str]
    model_root: str
    tokenizer: Any
    max_model_len: int
    executor: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="pagedserve-tokenizer"))
    chat_template: str | None = None
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    lora_requests: dict[str, LoRARequest] = field(default_factory=dict)

    def resolve_model(self, name: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's ``model`` names, or None for the base model (any of
        its names, or no ``model``). Raises ``APIError`` 404 for an unknown name."""
        if name is None or name in self.model_aliases:
            return None
        lora = self.lora_requests.get(name)
        if lora is None:
            raise APIError(404, f"The model `{name}` does not exist.", param="model",
                           code="model_not_found")
        return lora

    def check_model(self, name: str | None) -> None:
        """Raise a 404 unless ``name`` is None, one of the served model's names or a LoRA
        adapter's (which shares the base model's tokenizer)."""
        self.resolve_model(name)

    def current_lora(self, lora: LoRARequest | None) -> LoRARequest | None:
        """``lora`` if it is still served (None: the base model, always served). Raises
        ``APIError`` 404 once it has been unloaded: call it right before the engine gets a
        request, so that a request never brings back an unloaded adapter."""
        if lora is not None and self.lora_requests.get(lora.lora_name) is not lora:
            raise APIError(404, f"The model `{lora.lora_name}` does not exist.", param="model",
                           code="model_not_found")
        return lora

    def model_name(self, lora: LoRARequest | None) -> str:
        """The ``model`` of a response: the adapter's name, else the served model name
        (vLLM's rule)."""
        return self.served_model_name if lora is None else lora.lora_name

    async def run_tokenizer(self, fn: Callable[..., T], *args) -> T:
        """Run ``fn(*args)`` on the tokenizer thread."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def apply_chat_template(self, messages: list[ChatMessage], add_generation_prompt: bool,
                            continue_final_message: bool, kwargs: dict | None,
                            tools: list[dict] | None = None) -> list[int]:
        """Token ids of the conversation through the chat template (``--chat-template`` or
        the model's, as ``LLM.chat``), with ``tools`` (OpenAI's tool objects) given to the
        template as its ``tools`` variable. Raises ``APIError`` 400 for messages the
        template cannot take."""
        if self.tokenizer is None:
            raise APIError(400, "chat needs a tokenizer (skip_tokenizer_init was given)")
        if add_generation_prompt and continue_final_message:
            raise APIError(400, "add_generation_prompt and continue_final_message cannot both "
                                "be true", param="continue_final_message")
        conversation = [message_to_dict(m, i) for i, m in enumerate(messages)]
        extra = dict(kwargs or {})
        reserved = sorted(_TOKENIZE_OPTIONS.intersection(extra))
        if reserved:
            raise APIError(400, f"chat_template_kwargs may not set {', '.join(reserved)}: these "
                                "are tokenizer options, not template variables",
                           param="chat_template_kwargs")
        if continue_final_message:
            extra["continue_final_message"] = True
        if tools:
            extra["tools"] = tools
        if self.chat_template is not None:
            extra["chat_template"] = self.chat_template
        try:
            ids = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tokenize=True,
                return_dict=False, **extra)
        except Exception as err:  # jinja2 TemplateError, ValueError, TypeError from kwargs
            raise APIError(400, f"the chat template cannot render these messages: {err}",
                           param="messages") from err
        if ids and isinstance(ids[0], list):  # some versions batch a single conversation
            ids = ids[0]
        return list(ids)


# apply_chat_template's own options: they change what it returns (tensors, dicts, padded
# batches) rather than what the template renders, so a request may not set them.
_TOKENIZE_OPTIONS = frozenset({
    "tokenize", "return_tensors", "return_dict", "return_assistant_tokens_mask", "padding",
    "truncation", "max_length", "tokenizer_kwargs", "conversation"})


def message_to_dict(message: ChatMessage, index: int) -> dict:
    """A message as the chat template wants it; text parts are joined with newlines.

    Raises ``APIError`` 400 for non-text parts and text that is not valid Unicode. (A missing ``content`` is rejected by the
    message models already, except on an assistant turn, where it renders as "".)"""
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise APIError(400, f"content part of type {part.type!r} is not supported; "
                                    "only text parts are", param=f"messages[{index}].content")
            texts.append(part.text)
        content = "\n".join(texts)
    if content is not None:
        try:
            content.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate: valid JSON, not valid Unicode
            raise APIError(400, f"the content is not valid Unicode: {e.reason} at position "
                                f"{e.start}", param=f"messages[{index}].content") from e
    out = {"role": message.role, "content": content if content is not None else ""}
    if message.name is not None:
        out["name"] = message.name
    if getattr(message, "tool_call_id", None) is not None:
        out["tool_call_id"] = message.tool_call_id
    if getattr(message, "tool_calls", None):
        out["tool_calls"] = [_template_tool_call(c, index) for c in message.tool_calls]
    return out


def _template_tool_call(call, index: int) -> dict:
    """A tool call as chat templates take it: ``arguments`` as an object, not JSON text
    (templates apply ``tojson`` to it; vLLM converts the same way). Raises ``APIError``
    400 when the arguments are not a JSON object."""
    try:
        args = json.loads(call.function.arguments)
    except ValueError as err:
        raise APIError(400, f"tool call arguments are not valid JSON: {err}",
                       param=f"messages[{index}].tool_calls") from err
    return {"id": call.id, "type": call.type,
            "function": {"name": call.function.name, "arguments": args}}
