"""The engine's adapters by name and ``lora_int_id`` (no tensors: the worker's
``LoRAManager`` holds those).

Each registration gets an engine id that is never reused (``Request.lora_id``): the
prefix cache keys blocks by it, so an adapter unloaded and loaded again under the same
name (perhaps from other files) never meets the K/V of its previous load.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from pagedserve.lora.request import LoRARequest


class LoRAInUseError(RuntimeError):
    """An adapter cannot be removed while requests use it (the server answers 409)."""


@dataclass(frozen=True)
class RegisteredLoRA:
    """A registered adapter: how it was asked for, and its engine id."""

    request: LoRARequest
    lora_id: int


class LoRARegistry:
    """Registered adapters; the same adapter is asked for by the same name, id and path."""

    def __init__(self) -> None:
        self.by_int_id: dict[int, RegisteredLoRA] = {}
        self._next_id = itertools.count(1)

    def find(self, lora: LoRARequest) -> RegisteredLoRA | None:
        """The registration of ``lora``, or None if neither its id nor its name is known.

        Raises ``ValueError`` when its id or name is registered for another adapter (vLLM
        would silently serve the first one)."""
        known = self.by_int_id.get(lora.lora_int_id)
        same_name = self.by_name(lora.lora_name)
        if known is None and same_name is None:
            return None
        if known is None or same_name is not known or known.request.lora_path != lora.lora_path:
            other = known or same_name
            raise ValueError(
                f"LoRA adapter {lora.lora_name!r} (lora_int_id {lora.lora_int_id}, path "
                f"{lora.lora_path}) conflicts with the loaded {other.request.lora_name!r} "
                f"(lora_int_id {other.request.lora_int_id}, path {other.request.lora_path})")
        return known

    def by_name(self, name: str) -> RegisteredLoRA | None:
        return next((r for r in self.by_int_id.values() if r.request.lora_name == name), None)

    def add(self, lora: LoRARequest) -> RegisteredLoRA:
        entry = RegisteredLoRA(lora, next(self._next_id))
        self.by_int_id[lora.lora_int_id] = entry
        return entry

    def remove(self, lora_int_id: int) -> RegisteredLoRA | None:
        return self.by_int_id.pop(lora_int_id, None)

    def requests(self) -> list[LoRARequest]:
        """The registered adapters in registration order."""
        return [r.request for r in self.by_int_id.values()]
