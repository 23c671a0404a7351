"""``LoRARequest``: which adapter a request runs with (vLLM's ``vllm/lora/request.py``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, a positive integer id, and its PEFT directory.

    As in vLLM, ``lora_int_id`` identifies the adapter to the engine (requests with the
    same id share it; 0 means no adapter and is refused); ``lora_name`` is what the server
    lists and what requests put in ``model``. ``base_model_name`` is only reported (the
    ``parent`` of ``/v1/models``).

    Raises ``ValueError`` for an empty name, an id below 1 or an empty path.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string; got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) \
                or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1; got {self.lora_int_id!r}")
        if not self.lora_path:
            raise ValueError(f"LoRA adapter {self.lora_name!r}: lora_path is empty")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
