"""The FastAPI application of the OpenAI-compatible server (``api_server`` runs it).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``
(and ``/v1/models/{id}``), plus vLLM's ``GET /health``, ``GET /version``, ``GET /metrics``
(Prometheus text), ``POST /tokenize``, ``POST /detokenize``, the live ``/dashboard``
(``dashboard/``; off with ``--disable-dashboard``), and with runtime LoRA updating allowed
``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter`` (``serving_models``;
without it these routes do not exist: 404, as vLLM). A request's ``model`` may name a LoRA
adapter (``ServingContext.lora_requests``).

Errors always use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for
bad JSON, bad types, out-of-range values and prompts that do not fit; 401 for a missing or
wrong key when ``--api-key`` is set (``/v1/*`` as vLLM, and the dashboard's data); 404 for
an unknown model or route; 409 for unloading a LoRA adapter in use; 503 while shutting
down. Bad input never yields a 500.
"""

from __future__ import annotations

import contextlib
import time

from fastapi import FastAPI, Request
from fastapi.responses import Response

from pagedserve.engine.timeline import LatencyWindow
from pagedserve.entrypoints.openai.auth import APIKeyMiddleware
from pagedserve.entrypoints.openai.dashboard import PROTECTED_PATHS, add_dashboard_routes
from pagedserve.entrypoints.openai.errors import APIError, install_error_handlers
from pagedserve.entrypoints.openai.openapi import ERROR_RESPONSES, openapi_document
from pagedserve.entrypoints.openai.protocol import (
    LoadLoRAAdapterRequest,
    ModelList,
    UnloadLoRAAdapterRequest,
)
from pagedserve.entrypoints.openai.protocol_chat import ChatCompletionRequest
from pagedserve.entrypoints.openai.protocol_completion import CompletionRequest
from pagedserve.entrypoints.openai.protocol_tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from pagedserve.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedserve.entrypoints.openai.serving_engine import ServingContext
from pagedserve.entrypoints.openai.serving_models import LoRAAdapters, model_card, model_cards
from pagedserve.metrics import PrometheusStatLogger
from pagedserve.tokenizer import encode_text
from pagedserve.version import __version__


def build_app(ctx: ServingContext, stat_logger: PrometheusStatLogger | None = None,
              api_key: str | None = None, latency: LatencyWindow | None = None,
              enable_dashboard: bool = True,
              lora_adapters: LoRAAdapters | None = None) -> FastAPI:
    """The FastAPI application over a started or unstarted ``ctx.engine`` (the lifespan
    starts it and shuts it down). ``latency``: the window the dashboard's percentiles come
    from (the engine's stat logger must feed it). ``lora_adapters``: serve the runtime
    LoRA endpoints with it (None: no such routes)."""

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

    @app.get("/v1/models", responses=ERROR_RESPONSES)
    async def list_models() -> Response:
        return Response(ModelList(data=model_cards(ctx, created)).model_dump_json(),
                        media_type="application/json")

    @app.get("/v1/models/{model_id:path}", responses=ERROR_RESPONSES)
    async def retrieve_model(model_id: str) -> Response:
        card = model_card(ctx, ctx.resolve_model(model_id), created)
        return Response(card.model_dump_json(), media_type="application/json")

    @app.post("/v1/completions", responses=ERROR_RESPONSES)
    async def create_completion(body: CompletionRequest, raw: Request) -> Response:
        return await completion.create_completion(body, raw)

    @app.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Response:
        return await chat.create_chat_completion(body, raw)

    if lora_adapters is not None:
        @app.post("/v1/load_lora_adapter", response_class=Response, responses={
            200: {"description": "Loaded (vLLM's text)", "content": {"text/plain": {}}},
            **ERROR_RESPONSES})
        async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
            """Load a PEFT adapter directory and serve it under ``lora_name``."""
            text = await lora_adapters.load(body.lora_name, body.lora_path)
            return Response(text, media_type="text/plain")

        @app.post("/v1/unload_lora_adapter", response_class=Response, responses={
            200: {"description": "Unloaded (vLLM's text)", "content": {"text/plain": {}}},
            **ERROR_RESPONSES})
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
            """Stop serving adapter ``lora_name``; 409 while requests use it."""
            text = await lora_adapters.unload(body.lora_name)
            return Response(text, media_type="text/plain")

    @app.post("/tokenize", responses=ERROR_RESPONSES)
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

    @app.post("/detokenize", responses=ERROR_RESPONSES)
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
