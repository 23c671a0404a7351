"""The OpenAI-compatible HTTP server (``pagedserve serve``): the app of ``app`` on uvicorn.

The address is bound before the model loads, so a taken port fails at once. SIGINT/SIGTERM:
stop accepting connections, abort requests in flight (their streams end with an error
event), and exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
from pathlib import Path
from typing import Any

import uvicorn

from pagedserve.args import EngineArgs
from pagedserve.engine.async_engine import AsyncLLM
from pagedserve.engine.timeline import LatencyWindow, StatLoggers
from pagedserve.entrypoints.openai.app import build_app
from pagedserve.entrypoints.openai.cli_args import (
    RUNTIME_LORA_ENV,
    LoRAModulePath,
    runtime_lora_updating_allowed,
)
from pagedserve.entrypoints.openai.serving_engine import ServingContext
from pagedserve.entrypoints.openai.serving_models import LoRAAdapters
from pagedserve.metrics import PrometheusStatLogger
from pagedserve.model_loader.files import DEFAULT_MODEL
from pagedserve.version import __version__

logger = logging.getLogger("pagedserve.server")


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


def _lora_flags(args: argparse.Namespace, engine_args: EngineArgs
                ) -> tuple[list[LoRAModulePath], bool]:
    """(``--lora-modules``, whether runtime LoRA updating is allowed). Raises
    ``ValueError`` for ``--lora-modules`` or ``--allow-runtime-lora-updating`` without
    ``--enable-lora``; vLLM's environment variable alone is ignored then (with a warning),
    so that a shared environment does not stop servers without adapters."""
    modules = getattr(args, "lora_modules", None) or []
    flag = bool(getattr(args, "allow_runtime_lora_updating", False))
    runtime = runtime_lora_updating_allowed(flag)
    if not engine_args.enable_lora:
        for given, name in ((modules, "--lora-modules"), (flag, "--allow-runtime-lora-updating")):
            if given:
                raise ValueError(f"{name} needs --enable-lora")
        if runtime:
            logger.warning("%s is set but LoRA is off (no --enable-lora): no runtime "
                           "adapter endpoints", RUNTIME_LORA_ENV)
        return [], False
    return modules, runtime


def _serve(args: argparse.Namespace, sock: socket.socket) -> int:
    chat_template = load_chat_template(getattr(args, "chat_template", None))
    auto_tools, tool_parser = _tool_flags(args)
    engine_args = EngineArgs.from_cli_args(args)
    lora_modules, runtime_lora = _lora_flags(args, engine_args)
    dp = engine_args.data_parallel_size
    if dp > 1:
        from pagedserve.engine.data_parallel import DataParallelLLM

        engine = DataParallelLLM(engine_args)
    else:
        engine = AsyncLLM.from_engine_args(engine_args)
    core = engine.engine  # with data parallelism: replica 0's summary
    name, aliases = served_names(args, core.model_path)
    stat_logger = PrometheusStatLogger(
        name, core.max_model_len, engine_indexes=range(dp),
        max_lora=engine_args.max_loras if engine_args.enable_lora else None)
    stat_logger.log_cache_config_info(core.cache_config_info())
    latency = None if args.disable_dashboard else LatencyWindow()
    engine.stat_logger = stat_logger if latency is None else StatLoggers(stat_logger, latency)
    ctx = ServingContext(engine=engine, served_model_name=name, model_aliases=aliases,
                         model_root=str(core.model_path), tokenizer=core.tokenizer,
                         max_model_len=core.max_model_len, chat_template=chat_template,
                         enable_auto_tool_choice=auto_tools, tool_call_parser=tool_parser)
    lora_adapters = LoRAAdapters(ctx)
    if lora_modules:
        try:
            asyncio.run(lora_adapters.load_static(lora_modules))
        except BaseException:
            engine.shutdown()
            raise
    app = build_app(ctx, stat_logger, api_key=args.api_key, latency=latency,
                    enable_dashboard=not args.disable_dashboard,
                    lora_adapters=lora_adapters if runtime_lora else None)
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
    if engine_args.enable_lora:
        logger.info("LoRA adapters (max_loras %d, max_lora_rank %d): %s; runtime "
                    "load/unload %s", engine_args.max_loras, engine_args.max_lora_rank,
                    ", ".join(f"{m.name} ({m.path})" for m in lora_modules) or "none yet",
                    "allowed" if runtime_lora else "off")
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
