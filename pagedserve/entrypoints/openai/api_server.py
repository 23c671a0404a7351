"""The OpenAI-compatible HTTP server (``pagedserve serve``): FastAPI on uvicorn.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``
(and ``/v1/models/{id}``), plus vLLM's ``GET /health``, ``GET /version``, ``GET /metrics``
(Prometheus text), ``POST /tokenize``, ``POST /detokenize``, and the live ``/dashboard``
(``dashboard/``; off with ``--disable-dashboard``).

Errors always use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for
bad JSON, bad types, out-of-range values and prompts that do not fit; 401 for a missing or
wrong key when ``--api-key`` is set (``/v1/*`` as vLLM, and the dashboard's data); 404 for
an unknown model or route; 503 while shutting down. Bad input never yields a 500.

SIGINT/SIGTERM: stop accepting connections, abort requests in flight (their streams end
with an error event), and exit 0.
"""

from __future__ import annotations

import argparse
import contextlib
import hmac
import logging
import signal
import socket
import time
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic import TypeAdapter
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.version import __version__
from pagedserve.args import EngineArgs
from pagedserve.engine.async_engine import AsyncLLM
from pagedserve.engine.timeline import LatencyWindow, StatLoggers
from pagedserve.entrypoints.openai.dashboard import PROTECTED_PATHS, add_dashboard_routes
from pagedserve.entrypoints.openai.protocol import (
    MESSAGE_ROLES,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from pagedserve.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedserve.entrypoints.openai.serving_engine import APIError, ServingContext
from pagedserve.metrics import PrometheusStatLogger
from pagedserve.model_loader.files import DEFAULT_MODEL
from pagedserve.tokenizer import encode_text

logger = logging.getLogger("pagedserve.server")


# -- errors ---------------------------------------------------------------------------


def _loc_to_param(loc: tuple) -> str | None:
    """``("body", "messages", 0, "user", "content")`` -> ``"messages[0].content"``."""
    parts = [p for p in loc if p != "body"]
    # Drop the names of union members (pydantic adds e.g. "str", "list[int]") and the role
    # tag pydantic puts after a message's index (messages are a union chosen by role).
    out = ""
    for i, p in enumerate(parts):
        if isinstance(p, int):
            out += f"[{p}]"
        elif not _is_union_member(p, parts[i - 1] if i else None):
            out += f".{p}" if out else p
    return out or None


def _is_union_member(part: str, before: str | int | None) -> bool:
    if "[" in part or part in ("str", "int", "float", "bool") or part[:1].isupper():
        return True
    return part in MESSAGE_ROLES and isinstance(before, int)


def _error_param(err: dict) -> str | None:
    """The request field an error is about; for a bad or missing union tag (a message's
    ``role``), the tag field itself."""
    param = _loc_to_param(tuple(err.get("loc", ())))
    if err.get("type") in ("union_tag_invalid", "union_tag_not_found"):
        tag = str(err.get("ctx", {}).get("discriminator", "")).strip("'")
        param = f"{param}.{tag}" if param else tag
    return param


def _shown(value: object, limit: int = 80) -> str:
    """A rejected value as the error message quotes it: objects by type, long values cut
    (a body sent as text/plain arrives as bytes; a message must not echo megabytes)."""
    if isinstance(value, (dict, list)):
        return type(value).__name__
    if isinstance(value, bytes):
        return f"{len(value)} bytes that are not a JSON object"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def validation_error(exc: RequestValidationError) -> APIError:
    """The 400 for a request body FastAPI/pydantic rejected (JSON syntax, types, ranges)."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", first.get("msg", ""))
        return APIError(400, f"We could not parse the JSON body of your request: {detail}")
    if first.get("type") == "missing" and tuple(first.get("loc", ())) == ("body",):
        return APIError(400, "the request body is missing; send a JSON object")
    messages = []
    for err in errors[:5]:
        param = _error_param(err)
        value = err.get("input")
        shown = _shown(value)
        where = f"'{param}'" if param else "the request body"
        messages.append(f"Invalid value for {where}: {err.get('msg')} (got {shown})")
    if len(errors) > 5:
        messages.append(f"... and {len(errors) - 5} more")
    return APIError(400, "; ".join(messages), param=_error_param(first))


def install_error_handlers(app: FastAPI) -> None:
    """Map every error to OpenAI's error body (never FastAPI's default ``detail``)."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return APIError(404, "Not found: unknown route").response()
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def crash(_: Request, exc: Exception) -> JSONResponse:
        logger.error("unhandled error", exc_info=exc)
        return APIError(500, f"internal server error: {exc!r}").response()


class APIKeyMiddleware:
    """Require ``Authorization: Bearer <key>`` on ``/v1/*`` and on ``extra_paths`` (pure
    ASGI, so streaming and disconnect detection pass through untouched)."""

    def __init__(self, app, api_key: str, extra_paths: tuple[str, ...] = ()) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.extra_paths = frozenset(extra_paths)

    def _protected(self, path: str) -> bool:
        return path.startswith("/v1") or path in self.extra_paths

    async def __call__(self, scope, receive, send) -> None:
        if (scope["type"] != "http" or scope.get("method") == "OPTIONS"
                or not self._protected(scope.get("path", ""))):
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"authorization")
        if given is None:
            err = APIError(401, "You didn't provide an API key. Send it in the Authorization "
                                "header as 'Authorization: Bearer YOUR_KEY'.")
        elif not hmac.compare_digest(given, self.expected):
            err = APIError(401, "Incorrect API key provided.", code="invalid_api_key")
        else:
            return await self.app(scope, receive, send)
        await err.response()(scope, receive, send)


# -- the OpenAPI document -------------------------------------------------------------

# Every API error has OpenAI's body (declaring 4XX/5XX also drops FastAPI's default 422,
# which this server never sends: validation errors are 400s).
_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": ErrorResponse, "description": "Bad request, unknown model or route, "
                                                   "missing API key (OpenAI's error body)"},
    "5XX": {"model": ErrorResponse, "description": "Shutting down (OpenAI's error body)"},
}
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _int_bounds(schema: Any, found: dict[float, int]) -> None:
    """Collect the bounds of integer schemas in ``schema`` as ``float(bound) -> bound``."""
    if isinstance(schema, dict):
        if schema.get("type") == "integer":
            for key in _BOUNDS:
                if isinstance(schema.get(key), int):
                    found[float(schema[key])] = schema[key]
        for value in schema.values():
            _int_bounds(value, found)
    elif isinstance(schema, list):
        for value in schema:
            _int_bounds(value, found)


def _restore_int_bounds(schema: Any, exact: dict[float, int]) -> None:
    """Put back the exact integer bounds that FastAPI's OpenAPI model turned into floats
    (its ``maximum`` is a float field: 2**64 - 1 became 1.8446744073709552e+19)."""
    if isinstance(schema, dict):
        if schema.get("type") == "integer":
            for key in _BOUNDS:
                if isinstance(schema.get(key), float):
                    schema[key] = exact.get(schema[key], schema[key])
        for value in schema.values():
            _restore_int_bounds(value, exact)
    elif isinstance(schema, list):
        for value in schema:
            _restore_int_bounds(value, exact)


def openapi_document(app: FastAPI) -> dict[str, Any]:
    """``/openapi.json``: FastAPI's document, built from the request models that validate,
    with integer bounds exact as those models state them (``seed`` up to 2**64 - 1)."""
    if app.openapi_schema is None:
        spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
        exact: dict[float, int] = {}
        for route in app.routes:
            body = getattr(route, "body_field", None)
            if body is not None:
                _int_bounds(TypeAdapter(body.field_info.annotation).json_schema(), exact)
        _restore_int_bounds(spec, exact)
        app.openapi_schema = spec
    return app.openapi_schema


# -- the app --------------------------------------------------------------------------


def served_names(args: argparse.Namespace, model_path: Any) -> tuple[str, set[str]]:
    """(name shown in the API, every name a request may use)."""
    model = getattr(args, "model", None)
    name = getattr(args, "served_model_name", None) or model or DEFAULT_MODEL
    aliases = {name, str(model_path)}
    if model is not None:
        aliases.add(model)
    else:
        aliases.add(DEFAULT_MODEL)
    return name, aliases


def build_app(ctx: ServingContext, stat_logger: PrometheusStatLogger | None = None,
              api_key: str | None = None, latency: LatencyWindow | None = None,
              enable_dashboard: bool = True) -> FastAPI:
    """The FastAPI application over a started or unstarted ``ctx.engine`` (the lifespan
    starts it and shuts it down). ``latency``: the window the dashboard's percentiles come
    from (the engine's stat logger must feed it)."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        ctx.engine.start()
        yield
        ctx.engine.shutdown()
        ctx.executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="pagedserve", version=__version__, lifespan=lifespan)
    app.openapi = lambda: openapi_document(app)
    install_error_handlers(app)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key,
                           extra_paths=PROTECTED_PATHS if enable_dashboard else ())
    if enable_dashboard:
        add_dashboard_routes(app, ctx.engine, ctx.served_model_name, latency, bool(api_key))
    completion = OpenAIServingCompletion(ctx)
    chat = OpenAIServingChat(ctx)
    app.state.ctx = ctx
    created = int(time.time())

    def model_card() -> ModelCard:
        return ModelCard(id=ctx.served_model_name, created=created, root=ctx.model_root,
                         max_model_len=ctx.max_model_len)

    # Empty bodies (as vLLM): documented without a JSON content schema.
    @app.get("/health", response_class=Response, responses={
        200: {"description": "The engine runs (empty body)"},
        503: {"description": "The engine does not run (empty body)"}})
    async def health() -> Response:
        """200 while the engine thread runs, else 503."""
        return Response(status_code=200 if ctx.engine.is_running else 503)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics", response_class=Response, responses={200: {
        "description": "Prometheus text format", "content": {"text/plain": {}}}})
    async def metrics() -> Response:
        if stat_logger is None:
            raise APIError(404, "metrics are disabled")
        return Response(stat_logger.render(), media_type=stat_logger.CONTENT_TYPE)

    @app.get("/v1/models", responses=_ERROR_RESPONSES)
    async def list_models() -> Response:
        return Response(ModelList(data=[model_card()]).model_dump_json(),
                        media_type="application/json")

    @app.get("/v1/models/{model_id:path}", responses=_ERROR_RESPONSES)
    async def retrieve_model(model_id: str) -> Response:
        ctx.check_model(model_id)
        return Response(model_card().model_dump_json(), media_type="application/json")

    @app.post("/v1/completions", responses=_ERROR_RESPONSES)
    async def create_completion(body: CompletionRequest, raw: Request) -> Response:
        return await completion.create_completion(body, raw)

    @app.post("/v1/chat/completions", responses=_ERROR_RESPONSES)
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Response:
        return await chat.create_chat_completion(body, raw)

    @app.post("/tokenize", responses=_ERROR_RESPONSES)
    async def tokenize(body: TokenizeRequest) -> Response:
        ctx.check_model(body.model)
        if ctx.tokenizer is None:
            raise APIError(400, "the server has no tokenizer (skip_tokenizer_init)")
        if isinstance(body, TokenizeChatRequest):
            ids = await ctx.run_tokenizer(ctx.apply_chat_template, body.messages,
                                          body.add_generation_prompt,
                                          body.continue_final_message, body.chat_template_kwargs)
        else:
            try:
                ids = await ctx.run_tokenizer(encode_text, ctx.tokenizer, body.prompt,
                                              body.add_special_tokens)
            except ValueError as err:
                raise APIError(400, str(err), param="prompt") from err
        strs = None
        if body.return_token_strs:
            strs = await ctx.run_tokenizer(ctx.tokenizer.convert_ids_to_tokens, ids)
        out = TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids,
                               token_strs=strs)
        return Response(out.model_dump_json(), media_type="application/json")

    @app.post("/detokenize", responses=_ERROR_RESPONSES)
    async def detokenize(body: DetokenizeRequest) -> Response:
        ctx.check_model(body.model)
        if ctx.tokenizer is None:
            raise APIError(400, "the server has no tokenizer (skip_tokenizer_init)")
        vocab = len(ctx.tokenizer)
        bad = [t for t in body.tokens if t >= vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is out of the vocabulary [0, {vocab})",
                           param="tokens")
        text = await ctx.run_tokenizer(ctx.tokenizer.decode, body.tokens)
        return Response(DetokenizeResponse(prompt=text).model_dump_json(),
                        media_type="application/json")

    return app


# -- running it -----------------------------------------------------------------------


class _Server(uvicorn.Server):
    """uvicorn, but a signal also aborts the engine's requests, and the process then exits
    0 instead of re-raising the signal."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM) -> None:
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig: int, frame) -> None:
        if not self.should_exit:
            logger.info("received %s: shutting down", signal.Signals(sig).name)
        self.engine.abort_all()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        original = {sig: signal.signal(sig, self.handle_exit)
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def _url(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (uvicorn listens on it), made before the model
    loads so that a taken port fails at once, as vLLM binds its socket before the engine.

    Raises ``OSError`` (e.g. ``EADDRINUSE``) if it cannot be bound."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                  flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restart over TIME_WAIT
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def run_server(args: argparse.Namespace) -> int:
    """Load the model, serve until SIGINT/SIGTERM; returns the exit code: 0 after a signal,
    1 if the address cannot be bound (checked before the model loads) or the server could
    not start.

    Raises ``ValueError`` / ``FileNotFoundError`` from the engine for bad arguments."""
    try:
        sock = listen_socket(args.host, args.port)
    except OSError as err:
        logger.error("cannot listen on %s: %s", _url(args.host, args.port), err.strerror or err)
        return 1
    with sock:
        return _serve(args, sock)


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``: the text of the file it names, else the value itself when it
    looks like a Jinja template (vLLM's rule). Raises ``ValueError`` for a value that is
    neither (a mistyped path)."""
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        return path.read_text()
    if any(c in value for c in "{}\n"):
        return value
    raise ValueError(f"--chat-template: {value!r} is neither a readable file nor a template")


def _tool_flags(args: argparse.Namespace) -> tuple[bool, str | None]:
    """(``--enable-auto-tool-choice``, ``--tool-call-parser``); raises ``ValueError`` when
    the first is given without the second (vLLM's rule)."""
    auto = bool(getattr(args, "enable_auto_tool_choice", False))
    parser = getattr(args, "tool_call_parser", None)
    if auto and parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    return auto, parser


def _serve(args: argparse.Namespace, sock: socket.socket) -> int:
    chat_template = load_chat_template(getattr(args, "chat_template", None))
    auto_tools, tool_parser = _tool_flags(args)
    engine_args = EngineArgs.from_cli_args(args)
    dp = engine_args.data_parallel_size
    if dp > 1:
        from pagedserve.engine.data_parallel import DataParallelLLM

        engine = DataParallelLLM(engine_args)
    else:
        engine = AsyncLLM.from_engine_args(engine_args)
    core = engine.engine  # with data parallelism: replica 0's summary
    name, aliases = served_names(args, core.model_path)
    stat_logger = PrometheusStatLogger(name, core.max_model_len, engine_indexes=range(dp))
    stat_logger.log_cache_config_info(core.cache_config_info())
    latency = None if args.disable_dashboard else LatencyWindow()
    engine.stat_logger = stat_logger if latency is None else StatLoggers(stat_logger, latency)
    ctx = ServingContext(engine=engine, served_model_name=name, model_aliases=aliases,
                         model_root=str(core.model_path), tokenizer=core.tokenizer,
                         max_model_len=core.max_model_len, chat_template=chat_template,
                         enable_auto_tool_choice=auto_tools, tool_call_parser=tool_parser)
    app = build_app(ctx, stat_logger, api_key=args.api_key, latency=latency,
                    enable_dashboard=not args.disable_dashboard)
    block_size = core.args.block_size
    logger.info("pagedserve %s: model %s (%s)", __version__, name, core.model_path)
    logger.info("device %s, dtype %s, torch threads %d", core.device,
                str(core.dtype).removeprefix("torch."), engine.num_threads)
    logger.info("KV cache%s: %d blocks x %d tokens = %d tokens; max_model_len %d, "
                "max_num_seqs %d, max_num_batched_tokens %d",
                f" (each of {dp} data-parallel replicas)" if dp > 1 else "",
                core.num_blocks, block_size,
                core.num_blocks * block_size, core.max_model_len,
                core.scheduler_config.max_num_seqs, core.scheduler_config.max_num_batched_tokens)
    url = _url(args.host, args.port)
    logger.info("OpenAI-compatible API at %s/v1 (health: %s/health, metrics: %s/metrics%s)%s",
                url, url, url, "" if args.disable_dashboard else f", dashboard: {url}/dashboard",
                "; API key required" if args.api_key else "")
    config = uvicorn.Config(app, host=args.host, port=args.port,
                            log_level=args.uvicorn_log_level, timeout_graceful_shutdown=5,
                            timeout_keep_alive=5)
    server = _Server(config, engine)
    try:
        server.run(sockets=[sock])
    except SystemExit as exc:  # uvicorn exits 1 when it cannot start
        return exc.code if isinstance(exc.code, int) else 1
    finally:
        engine.shutdown()
    if not server.started:
        return 1
    logger.info("server stopped")
    return 0
