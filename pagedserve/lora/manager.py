"""The worker's adapters: which are loaded (``max_cpu_loras``, least recently used
evicted), which sit in the model's slots (``max_loras``), and each token's slot for a step.

The engine registers an adapter (an id it never reuses, a path, and the ``LoRAAdapter``
read off the engine thread); an evicted one is read again from its path on its next use.
The scheduler guarantees a step uses at most ``max_loras`` adapters, so ``prepare_step``
always finds slots: it keeps the slots of adapters still in use and fills the others.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from pagedserve.lora.adapter import LoRAAdapter, load_adapter
from pagedserve.lora.config import LoRAConfig
from pagedserve.lora.layers import add_lora_layers, lora_targets


class LoRAManager:
    """Adds LoRA layers to ``model`` and keeps its slots (see the module docstring)."""

    def __init__(self, model: nn.Module, config: LoRAConfig) -> None:
        self.config = config
        self.targets = lora_targets(model)
        model_dtype = model.norm.weight.dtype
        self.batch, self.stacks = add_lora_layers(model, config.max_loras, config.max_lora_rank,
                                                  config.stack_dtype(model_dtype))
        self.device = model.norm.weight.device
        self.paths: dict[int, tuple[str, str]] = {}  # id -> (name, path)
        self.loaded: OrderedDict[int, LoRAAdapter] = OrderedDict()  # least recent first
        self.slot_ids: list[int | None] = [None] * config.max_loras

    @property
    def num_bytes(self) -> int:
        """Bytes of the slot stacks (the loaded adapters come on top)."""
        return sum(t.numel() * t.element_size() for s in self.stacks.values()
                   for t in s.kernel_tensors())

    def load(self, name: str, path: str) -> LoRAAdapter:
        """Read and check an adapter for this model (``load_adapter``; thread-safe: it
        touches nothing here). Raises ``ValueError``."""
        return load_adapter(name, path, self.targets, self.config.max_lora_rank)

    def add(self, lora_id: int, adapter: LoRAAdapter) -> None:
        """Register a loaded adapter under ``lora_id``."""
        self.paths[lora_id] = (adapter.name, adapter.path)
        self._keep(lora_id, adapter)

    def remove(self, lora_id: int) -> None:
        """Forget an adapter (the engine checked that no request uses it)."""
        self.paths.pop(lora_id, None)
        self.loaded.pop(lora_id, None)
        if lora_id in self.slot_ids:
            self.slot_ids[self.slot_ids.index(lora_id)] = None

    def _keep(self, lora_id: int, adapter: LoRAAdapter) -> None:
        self.loaded[lora_id] = adapter
        self.loaded.move_to_end(lora_id)
        while len(self.loaded) > self.config.cpu_capacity:
            self.loaded.popitem(last=False)

    def _adapter(self, lora_id: int) -> LoRAAdapter:
        adapter = self.loaded.get(lora_id)
        if adapter is None:  # evicted: read it again (it loaded before, so it still fits)
            adapter = self.load(*self.paths[lora_id])
        self._keep(lora_id, adapter)
        return adapter

    def prepare_step(self, lora_ids: list[int], query_lens: list[int]) -> None:
        """Set the token slots of a step whose sequence i computes ``query_lens[i]``
        tokens with adapter ``lora_ids[i]`` (0: none). Raises ``RuntimeError`` if the step
        uses more than ``max_loras`` adapters (the scheduler's job to prevent)."""
        used = list(dict.fromkeys(i for i in lora_ids if i))
        if not used:
            self.batch.slots = None
            return
        if len(used) > self.config.max_loras:
            raise RuntimeError(f"a step uses {len(used)} adapters, above max_loras "
                               f"{self.config.max_loras}")
        for lora_id in used:
            if lora_id not in self.slot_ids:
                self._fill(self._free_slot(used), lora_id)
            elif lora_id in self.loaded:
                self.loaded.move_to_end(lora_id)
        slot_of = {lora_id: self.slot_ids.index(lora_id) for lora_id in used}
        per_seq = torch.tensor([slot_of.get(i, -1) for i in lora_ids], dtype=torch.int64)
        slots = torch.repeat_interleave(per_seq, torch.tensor(query_lens, dtype=torch.int64))
        self.batch.slots = slots.to(self.device)

    def _free_slot(self, used: list[int]) -> int:
        """An empty slot, else one whose adapter this step does not use."""
        for slot, lora_id in enumerate(self.slot_ids):
            if lora_id is None:
                return slot
        return next(s for s, i in enumerate(self.slot_ids) if i not in used)

    def _fill(self, slot: int, lora_id: int) -> None:
        adapter = self._adapter(lora_id)
        for module, stack in self.stacks.items():
            stack.set_slot(slot, adapter.projections.get(module))
        self.slot_ids[slot] = lora_id
