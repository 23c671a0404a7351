"""The engine's adapters by name and ``lora_int_id``; the tensors are the worker's
``LoRAManager``'s.

Each registration gets an engine id that is never reused (``Request.lora_id``): the
prefix cache keys blocks by it, so an adapter unloaded and loaded again under the same
name (perhaps from other files) never meets the K/V of its previous load.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from pagedserve.lora.adapter import LoRAAdapter
from pagedserve.lora.manager import LoRAManager
from pagedserve.lora.request import LoRARequest


class LoRAInUseError(RuntimeError):
    """An adapter cannot be removed while requests use it (the server answers 409)."""


@dataclass(frozen=True)
class RegisteredLoRA:
    """A registered adapter: how it was asked for, and its engine id."""

    request: LoRARequest
    lora_id: int


class LoRARegistry:
    """Registered adapters (see the module docstring).

    Args:
        manager: the worker's ``LoRAManager``, or None without ``enable_lora`` (then
            every method that needs an adapter raises ``ValueError``).
        num_users: the number of unfinished requests using an engine id.
    """

    def __init__(self, manager: LoRAManager | None, num_users: Callable[[int], int]) -> None:
        self.manager = manager
        self.num_users = num_users
        self.by_int_id: dict[int, RegisteredLoRA] = {}
        self._next_id = itertools.count(1)

    def load(self, lora: LoRARequest) -> LoRAAdapter:
        """Read and check ``lora``'s adapter without registering it: touches nothing here,
        so the server runs it off the engine thread. Raises ``ValueError``."""
        return self._manager().load(lora.lora_name, lora.lora_path)

    def add(self, lora: LoRARequest, adapter: LoRAAdapter | None = None) -> int:
        """Register ``lora`` (``adapter``: its ``load`` result, else it is loaded now),
        unless it already is; returns its engine id. Raises ``ValueError`` for a bad
        adapter, or a name or id registered for another adapter."""
        manager = self._manager()
        entry = self.find(lora)
        if entry is None:
            adapter = adapter or self.load(lora)
            entry = RegisteredLoRA(lora, next(self._next_id))
            manager.add(entry.lora_id, adapter)
            self.by_int_id[lora.lora_int_id] = entry
        return entry.lora_id

    def remove(self, lora_int_id: int) -> bool:
        """Unregister an adapter; False if unknown. Raises ``LoRAInUseError`` while an
        unfinished request uses it (nothing changes then)."""
        entry = self.by_int_id.get(lora_int_id)
        if entry is None:
            return False
        users = self.num_users(entry.lora_id)
        if users:
            raise LoRAInUseError(f"LoRA adapter {entry.request.lora_name!r} is in use by "
                                 f"{users} unfinished requests")
        del self.by_int_id[lora_int_id]
        self._manager().remove(entry.lora_id)
        return True

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

    def requests(self) -> list[LoRARequest]:
        """The registered adapters in registration order."""
        return [r.request for r in self.by_int_id.values()]

    def _manager(self) -> LoRAManager:
        if self.manager is None:
            raise ValueError("LoRA adapters need enable_lora=True (--enable-lora)")
        return self.manager
