"""Server flags that need parsing of their own (vLLM's ``cli_args.py``): ``--lora-modules``
and whether LoRA adapters may be loaded and unloaded at runtime.

Kept free of the server's imports, so that ``pagedserve --help`` stays quick.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass

# vLLM's environment variable; --allow-runtime-lora-updating is the same switch as a flag.
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


@dataclass(frozen=True)
class LoRAModulePath:
    """One ``--lora-modules`` item: the adapter's name (a request's ``model``), its PEFT
    directory, and the base model it is listed under (``parent`` in ``/v1/models``; it
    must be one of the served model's names; default: the served model name)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(item: str) -> LoRAModulePath:
    """``name=path`` (the path may hold ``=``) or vLLM's JSON form ``{"name": ...,
    "path": ..., "base_model_name": ...}``. Raises ``ValueError`` naming what is wrong."""
    if item.lstrip().startswith("{"):
        try:
            fields = json.loads(item)
        except json.JSONDecodeError as err:
            raise ValueError(f"invalid JSON {item!r}: {err}") from err
        if not isinstance(fields, dict):
            raise ValueError(f"{item!r} is not a JSON object")
        unknown = sorted(set(fields) - {"name", "path", "base_model_name"})
        if unknown:
            raise ValueError(f"{item!r}: unknown fields {unknown} (expected name, path and "
                             "optionally base_model_name)")
        name, path, base = fields.get("name"), fields.get("path"), fields.get("base_model_name")
        if not all(isinstance(v, str) for v in (name, path)) or not (
                base is None or isinstance(base, str)):
            raise ValueError(f"{item!r}: name and path must be strings (and base_model_name "
                             "a string if given)")
    else:
        name, sep, path = item.partition("=")
        base = None
        if not sep:
            raise ValueError(f"{item!r} is neither name=path nor a JSON object")
    if not name or not path:
        raise ValueError(f"{item!r}: the name and the path must not be empty")
    return LoRAModulePath(name, path, base)


class LoRAParserAction(argparse.Action):
    """``--lora-modules ITEM [ITEM ...]`` -> a list of ``LoRAModulePath`` (empty items are
    skipped, as vLLM's); a bad item is a usage error naming it."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        modules = []
        for item in values or []:
            if not item:
                continue
            try:
                modules.append(parse_lora_module(item))
            except ValueError as err:
                parser.error(f"{option_string}: {err}")
        setattr(namespace, self.dest, modules)


def add_lora_server_args(parser: argparse.ArgumentParser) -> None:
    """``--lora-modules`` and ``--allow-runtime-lora-updating`` (the engine's own LoRA
    flags, ``--enable-lora`` and its limits, are ``EngineArgs``')."""
    parser.add_argument(
        "--lora-modules", nargs="+", action=LoRAParserAction, default=None,
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) loaded at start, each name=path or JSON "
             '{"name": ..., "path": ..., "base_model_name": ...}; a request picks one by '
             "its model field (needs --enable-lora)")
    parser.add_argument(
        "--allow-runtime-lora-updating", action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (needs "
             f"--enable-lora; also on with {RUNTIME_LORA_ENV}=1 or true, vLLM's switch)")


def runtime_lora_updating_allowed(flag: bool, environ: Mapping[str, str] | None = None) -> bool:
    """``--allow-runtime-lora-updating``, or vLLM's environment variable set to ``1`` or
    ``true`` (any case), as vLLM reads it."""
    environ = os.environ if environ is None else environ
    return flag or environ.get(RUNTIME_LORA_ENV, "0").strip().lower() in ("1", "true")
