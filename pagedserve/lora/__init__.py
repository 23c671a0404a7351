"""Multi-LoRA serving: PEFT adapters (Hu et al. 2021, "LoRA") on one base model, many in
one batch, as vLLM's ``--enable-lora`` (Punica, Chen et al. 2023; S-LoRA, Sheng et al. 2023).

- ``request``: ``LoRARequest``, how a request names its adapter (vLLM's class).
- ``config``: ``LoRAConfig``, the engine's limits (``--max-loras`` and friends).
- ``adapter``: reading and checking a PEFT adapter directory into per-projection A/B.
- ``layers``: the ``LinearWeight`` that adds the LoRA term to any base weight, and the
  slot stacks it reads.
- ``manager``: the worker's adapters: loaded ones (LRU), slots of the step, per-token slot.
- ``registry``: the engine's adapters by name and id (no tensors).
"""

from pagedserve.lora.request import LoRARequest

__all__ = ["LoRARequest"]
