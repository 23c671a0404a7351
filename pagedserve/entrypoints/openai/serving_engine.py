"""What the completion and chat handlers share: errors, model names, sampling parameters,
tokenizer calls off the event loop, merging request streams, and client disconnects."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import math
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedserve.engine.async_engine import (
    AsyncLLM,
    EngineClosedError,
    EngineStepError,
    RequestAbortedError,
    RequestStream,
)
from pagedserve.entrypoints.openai.protocol import (
    MIN_LOGPROB,
    ChatMessage,
    ErrorInfo,
    ErrorResponse,
    SamplingFields,
)
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)
T = TypeVar("T")

_ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
                404: "invalid_request_error", 405: "invalid_request_error",
                413: "invalid_request_error", 422: "invalid_request_error",
                500: "server_error", 503: "server_error"}


class APIError(Exception):
    """An error answered with OpenAI's error body.

    Args:
        status: HTTP status (400 bad input, 401 bad key, 404 unknown model or route,
            500 server bug, 503 shutting down).
        message: human-readable explanation.
        param: the request field at fault, if any.
        code: OpenAI's machine-readable code (``model_not_found``, ``invalid_api_key``).
    """

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, err_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.err_type = err_type or _ERROR_TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        """``{"error": {"message", "type", "param", "code"}}``."""
        info = ErrorInfo(message=self.message, type=self.err_type, param=self.param,
                         code=self.code)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


_FIELD = re.compile(r"^([a-z_]+)\b")


def bad_request(err: Exception, known: set[str] | None = None) -> APIError:
    """A 400 for a ``ValueError`` from the engine or ``SamplingParams``; ``param`` is the
    field its message starts with, when that is a request field."""
    message = str(err)
    match = _FIELD.match(message)
    param = match.group(1) if match and (known is None or match.group(1) in known) else None
    return APIError(400, message, param=param)


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

    def check_model(self, name: str | None) -> None:
        """Raise a 404 unless ``name`` is None or one of the served model's names."""
        if name is not None and name not in self.model_aliases:
            raise APIError(404, f"The model `{name}` does not exist.", param="model",
                           code="model_not_found")

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


_SAMPLING_NAMES = {
    "structured_outputs", "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p",
    "top_k", "min_p", "seed", "stop", "stop_token_ids", "max_tokens", "min_tokens", "logprobs",
    "logit_bias", "prompt_logprobs", "truncate_prompt_tokens",
}


@dataclass
class Constraint:
    """A request's structured-output constraint and where it came from.

    Attributes:
        spec: the engine's constraint.
        param: the top-level request field it came from (``response_format``,
            ``structured_outputs``, ``guided_regex``, ``tool_choice``, ...).
        label: how error messages name the constraint's value (``guided_regex``,
            ``response_format.json_schema.schema``).
    """

    spec: StructuredOutputsParams
    param: str
    label: str

    def rename(self, err: APIError) -> APIError:
        """An engine error about ``structured_outputs.<kind>`` restated with this
        constraint's field (the engine names its own parameter)."""
        kind = self.spec.kinds()[0]
        prefix = f"structured_outputs.{kind}"
        if err.message.startswith(prefix):
            err.message = self.label + err.message[len(prefix):]
            err.param = self.param
        return err


_GUIDED = ("json", "regex", "choice", "grammar")


def request_constraint(req: SamplingFields, tool_schema: dict | None = None
                       ) -> Constraint | None:
    """The constraint of ``tool_choice`` (``tool_schema``, the schema of a forced tool
    call), ``response_format``, ``structured_outputs`` or a ``guided_*`` field, or None.
    ``structured_outputs`` with only ``disable_any_whitespace`` set adds that option to
    another constraint.

    Raises ``APIError`` 400 naming the field when several constraints are given or one is
    malformed."""
    found: list[tuple[str, str, dict]] = []
    if tool_schema is not None:
        found.append(("tool_choice", "tool_choice", {"json": tool_schema}))
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", "response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise APIError(400, "response_format of type json_schema needs json_schema.schema",
                           param="response_format")
        found.append(("response_format", "response_format.json_schema.schema",
                      {"json": fmt.json_schema.json_schema}))
    so = req.structured_outputs
    no_ws = bool(so and so.disable_any_whitespace)
    if so is not None:
        kinds = {"json": so.json_, "regex": so.regex, "choice": so.choice,
                 "grammar": so.grammar, "json_object": so.json_object or None}
        kinds = {k: v for k, v in kinds.items() if v is not None}
        if kinds or not found:
            found.append(("structured_outputs", "structured_outputs", kinds))
    for kind in _GUIDED:
        value = getattr(req, f"guided_{kind}")
        if value is not None:
            found.append((f"guided_{kind}", f"guided_{kind}", {kind: value}))
    if len(found) > 1:
        names = [f[0] for f in found]
        raise APIError(400, f"only one kind of constraint may be given; got {names}",
                       param=found[1][0])
    if not found:
        return None
    param, label, kwargs = found[0]
    try:
        spec = StructuredOutputsParams(**kwargs, disable_any_whitespace=no_ws)
    except ValueError as err:
        raise APIError(400, f"{param}: {err}", param=param) from err
    if param == "structured_outputs":
        label = f"structured_outputs.{spec.kinds()[0]}"
    return Constraint(spec, param, label)


def sampling_params(req: SamplingFields, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None = None,
                    constraint: Constraint | None = None) -> SamplingParams:
    """``SamplingParams`` of a request (None fields take their defaults), constrained by
    ``constraint`` if given.

    Raises ``APIError`` 400 naming the field for an out-of-range value."""
    def pick(value, default):
        return default if value is None else value

    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed when stream is true",
                       param="stream_options")
    try:
        return SamplingParams(
            n=pick(req.n, 1),
            presence_penalty=pick(req.presence_penalty, 0.0),
            frequency_penalty=pick(req.frequency_penalty, 0.0),
            repetition_penalty=pick(req.repetition_penalty, 1.0),
            temperature=pick(req.temperature, 1.0),
            top_p=pick(req.top_p, 1.0),
            top_k=pick(req.top_k, 0),
            min_p=pick(req.min_p, 0.0),
            seed=req.seed,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=pick(req.ignore_eos, False),
            max_tokens=max_tokens,
            min_tokens=pick(req.min_tokens, 0),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=pick(req.skip_special_tokens, True),
            spaces_between_special_tokens=pick(req.spaces_between_special_tokens, True),
            include_stop_str_in_output=pick(req.include_stop_str_in_output, False),
            logit_bias=req.logit_bias,
            truncate_prompt_tokens=req.truncate_prompt_tokens,
            structured_outputs=None if constraint is None else constraint.spec,
        )
    except ValueError as err:
        raise bad_request(err, _SAMPLING_NAMES) from err


async def add_requests(engine: AsyncLLM, base_id: str, prompts: list, params: SamplingParams,
                       arrival_time: float, prompt_param: str = "prompt",
                       indexed: bool = False,
                       constraint: Constraint | None = None) -> list[RequestStream]:
    """Add one engine request per prompt (ids ``base_id`` or ``base_id-i``); all or none.

    Raises ``APIError`` 400 for a prompt the engine rejects: ``param`` is the sampling field
    named in the message, else ``prompt_param``, or with ``indexed`` (a batch of prompts)
    ``prompt_param[i]``, which then also starts the message; a constraint that does not
    compile names ``constraint``'s field. 503 when the engine is shutting down."""
    streams: list[RequestStream] = []
    i = 0
    try:
        for i, prompt in enumerate(prompts):
            rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
            streams.append(await engine.add_request(rid, prompt, params, arrival_time))
    except BaseException as err:
        for s in streams:
            s.abort()
        if isinstance(err, ValueError):
            api = bad_request(err, _SAMPLING_NAMES)
            if constraint is not None:
                api = constraint.rename(api)
            if api.param is None:
                api.param = f"{prompt_param}[{i}]" if indexed else prompt_param
                if indexed:
                    api.message = f"{api.param}: {api.message}"
            raise api from err
        if isinstance(err, EngineClosedError):
            raise APIError(503, str(err)) from err
        raise
    return streams


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield ``(prompt index, output)`` from several request streams as outputs arrive, until
    all finish. Raises the first stream error; leaving early aborts the unfinished ones."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out, None))
        except Exception as err:  # noqa: BLE001 - re-raised by the consumer below
            queue.put_nowait((i, None, err))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(streams)
    try:
        while remaining:
            i, out, err = await queue.get()
            if err is not None:
                raise err
            yield i, out
            if out.finished:
                remaining -= 1
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()


def engine_error(err: Exception) -> APIError:
    """The API error for a failed request: shutdown 503, engine step failure or a bug 500."""
    if isinstance(err, APIError):
        return err
    if isinstance(err, (RequestAbortedError, EngineClosedError)):
        return APIError(503, str(err))
    if isinstance(err, EngineStepError):
        return APIError(500, str(err))
    return APIError(500, f"internal error: {err!r}")


def sse(payload: str) -> str:
    """One server-sent event carrying a JSON payload (or ``[DONE]``)."""
    return f"data: {payload}\n\n"


def sse_error(err: Exception) -> str:
    """An error event in the middle of a stream (the body OpenAI's clients raise from)."""
    return sse(json.dumps(engine_error(err).body()))


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """Await ``work`` unless the client goes away first; then cancel it (which aborts its
    engine requests) and return an unsent 499."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        watcher.cancel()
    if task.cancelled():
        logger.info("client disconnected: request aborted")
        return Response(status_code=499)
    return task.result()
