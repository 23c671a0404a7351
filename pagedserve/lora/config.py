"""``LoRAConfig``: the engine's LoRA limits, from vLLM's engine arguments."""

from __future__ import annotations

from dataclasses import dataclass

import torch

LORA_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class LoRAConfig:
    """Attributes:
        max_loras: adapters one step may use (the grouped kernel's slots); vLLM's default 1.
        max_lora_rank: the largest rank an adapter may have (slots are this wide); vLLM's
            default 16.
        max_cpu_loras: adapters kept loaded in memory (least recently used evicted and
            read again on their next use); at least ``max_loras``, default ``max_loras``.
        lora_dtype: what the slots hold the adapters in (vLLM's ``--lora-dtype``):
            ``auto`` (the model's dtype), ``float32`` or ``bfloat16``. A step reads every
            adapter it uses whole, so on a memory-bound CPU bfloat16 halves that cost; the
            adapters' values are then rounded to bfloat16.

    Raises ``ValueError`` for a value below 1, ``max_cpu_loras < max_loras`` or another
    ``lora_dtype``.
    """

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str = "auto"

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            value = getattr(self, name)
            if value is None and name == "max_cpu_loras":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1; got {value!r}")
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"lora_dtype must be one of {', '.join(LORA_DTYPES)}; got "
                             f"{self.lora_dtype!r}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras})")

    def stack_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The slots' dtype for a model computing in ``model_dtype``."""
        return model_dtype if self.lora_dtype == "auto" else LORA_DTYPES[self.lora_dtype]

    @property
    def cpu_capacity(self) -> int:
        """How many adapters stay loaded."""
        return self.max_cpu_loras or self.max_loras

    @classmethod
    def from_engine_args(cls, args, spec=None) -> LoRAConfig | None:
        """The config of ``args`` (``EngineArgs``; ``spec``: its ``SpeculativeConfig``),
        or None without ``enable_lora``.

        Raises ``ValueError`` for what LoRA does not combine with (yet): more than one
        rank or replica, and speculative decoding with a model drafter (it would draft
        without the adapter)."""
        if not args.enable_lora:
            return None
        if args.tensor_parallel_size > 1 or args.data_parallel_size > 1:
            raise ValueError("enable_lora: LoRA adapters are served on one rank and one "
                             "replica (tensor_parallel_size and data_parallel_size 1)")
        if spec is not None and spec.method != "ngram":
            raise ValueError(f"enable_lora: speculative decoding with method {spec.method!r} "
                             "drafts without the adapter; use method ngram")
        return cls(args.max_loras, args.max_lora_rank, args.max_cpu_loras, args.lora_dtype)
