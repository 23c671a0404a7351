"""The served models: ``/v1/models``' cards (the base model, then each LoRA adapter with
``parent`` = the base model's name and ``root`` = its directory, as vLLM lists them), and
the server's adapters: loaded at start (``--lora-modules``) and, with runtime updating
allowed, by vLLM's ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.

Loading reads and checks the files on a worker thread (``LoRARegistry.load``), never on
the engine thread, which keeps stepping; the engine then registers the result between two
steps (``AsyncLLM.run_between_steps``). An adapter becomes visible to requests (and to
``/v1/models``) only once registered, and a failed load leaves nothing behind.

Unloading first hides the name (new requests get 404), then asks the engine to remove the
adapter: the engine refuses while an unfinished request uses it (``LoRAInUseError``), and
the answer is 409 with the adapter served as before. Requests check their adapter again
right before they reach the engine (``ServingContext.current_lora``); as the engine applies
commands in order, a request either reaches it before the removal (and makes it 409) or
finds the name gone (404): an unloaded adapter is never brought back.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

from pagedserve.engine.request_stream import EngineClosedError
from pagedserve.entrypoints.openai.cli_args import LoRAModulePath
from pagedserve.entrypoints.openai.errors import APIError, engine_error
from pagedserve.entrypoints.openai.protocol import ModelCard
from pagedserve.entrypoints.openai.serving_engine import ServingContext
from pagedserve.lora.registry import LoRAInUseError
from pagedserve.lora.request import LoRARequest

logger = logging.getLogger("pagedserve.server")
T = TypeVar("T")


def model_card(ctx: ServingContext, lora: LoRARequest | None, created: int) -> ModelCard:
    """The card of the base model (``lora`` None) or of an adapter (vLLM's: ``root`` its
    path, ``parent`` its base model's name, no ``max_model_len``)."""
    if lora is None:
        return ModelCard(id=ctx.served_model_name, created=created, root=ctx.model_root,
                         max_model_len=ctx.max_model_len)
    return ModelCard(id=lora.lora_name, created=created, root=lora.lora_path,
                     parent=lora.base_model_name or ctx.served_model_name)


def model_cards(ctx: ServingContext, created: int) -> list[ModelCard]:
    """``/v1/models``: the base model, then the adapters in load order."""
    loras = sorted(ctx.lora_requests.values(), key=lambda lora: lora.lora_int_id)
    return [model_card(ctx, None, created)] + [model_card(ctx, lora, created) for lora in loras]


class LoRAAdapters:
    """Loads and unloads the adapters of ``ctx`` (``ctx.lora_requests``); see the module
    docstring. Adapters get ``lora_int_id`` 1, 2, ... in load order, never reused (vLLM's
    counter). Loads and unloads run one at a time; a client that disconnects midway does
    not cut one short.

    Success answers are vLLM's texts; errors are ``APIError``: 400 (missing field, a name
    already served, an adapter that does not load: the engine's message names the
    problem), 404 (unload of an unknown name), 409 (unload of an adapter in use), 503
    (the engine is shutting down).
    """

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx
        self._ids = itertools.count(1)
        self._lock: asyncio.Lock | None = None  # made on the serving loop, on first use

    async def load_static(self, modules: list[LoRAModulePath]) -> None:
        """Load ``--lora-modules`` in order (before serving). Raises ``ValueError`` naming
        the first module that does not load."""
        for module in modules:
            try:  # nothing else runs yet: no need to serialize
                await self._load(module.name, module.path, module.base_model_name)
            except APIError as err:
                raise ValueError(f"--lora-modules {module.name}: {err.message}") from err

    async def load(self, name: str, path: str, base_model_name: str | None = None) -> str:
        """Load the adapter in directory ``path`` and serve it as ``name``
        (``base_model_name``: its ``parent``, one of the base model's names). Returns
        vLLM's success text; raises ``APIError`` (see the class docstring)."""
        return await asyncio.shield(self._serialized(self._load(name, path, base_model_name)))

    async def _load(self, name: str, path: str, base_model_name: str | None) -> str:
        ctx = self.ctx
        if not name or not path:
            raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.",
                           param="lora_path" if name else "lora_name")
        if base_model_name is not None and base_model_name not in ctx.model_aliases:
            raise APIError(400, f"base_model_name {base_model_name!r} is not a name of the "
                                f"served model {ctx.served_model_name!r}")
        if name in ctx.lora_requests:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.",
                           param="lora_name")
        if name in ctx.model_aliases:
            raise APIError(400, f"'{name}' is the base model's name; give the adapter "
                                "another", param="lora_name")
        lora = LoRARequest(name, next(self._ids), path, base_model_name)
        try:
            adapter = await asyncio.to_thread(ctx.engine.engine.loras.load, lora)
            await ctx.engine.run_between_steps(lambda engine: engine.loras.add(lora, adapter))
        except (ValueError, OSError) as err:
            raise APIError(400, str(err), param="lora_path") from err
        except EngineClosedError as err:
            raise engine_error(err) from err
        ctx.lora_requests[name] = lora
        logger.info("Loaded new LoRA adapter: name '%s', path '%s'", name, path)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, name: str) -> str:
        """Stop serving adapter ``name``. Returns vLLM's success text; raises ``APIError``
        404 for an unknown name, 409 while unfinished requests use it (nothing changes)."""
        if not name:
            raise APIError(400, "'lora_name' must be provided.", param="lora_name")
        return await asyncio.shield(self._serialized(self._unload(name)))

    async def _unload(self, name: str) -> str:
        ctx = self.ctx
        lora = ctx.lora_requests.pop(name, None)  # new requests for it: 404 from here
        if lora is None:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.",
                           param="lora_name", code="model_not_found")
        try:
            await ctx.engine.run_between_steps(
                lambda engine: engine.remove_lora(lora.lora_int_id))
        except LoRAInUseError as err:
            ctx.lora_requests[name] = lora
            raise APIError(409, f"{err}; nothing was unloaded (try again once they finish)",
                           param="lora_name") from err
        except BaseException as err:
            ctx.lora_requests[name] = lora
            if isinstance(err, EngineClosedError):
                raise engine_error(err) from err
            raise
        logger.info("Removed LoRA adapter: name '%s'", name)
        return f"Success: LoRA adapter '{name}' removed successfully."

    async def _serialized(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` once no other load or unload runs."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            return await coro
