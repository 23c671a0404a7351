"""Maps Hugging Face ``architectures`` names (and GGUF ``general.architecture``) to our
model classes.

A GGUF file's architecture is first turned into a Hugging Face config by
``model_loader/gguf_file.py`` (``GGUF_ARCHITECTURES``: e.g. ``gemma3`` ->
``Gemma3ForCausalLM``), then looked up here.
"""

from __future__ import annotations

from torch import nn

from pagedserve.model_loader.gguf_file import GGUF_ARCHITECTURES
from pagedserve.models.gemma3 import Gemma3ForCausalLM
from pagedserve.models.glm4 import Glm4ForCausalLM, GlmForCausalLM
from pagedserve.models.llama import LlamaForCausalLM
from pagedserve.models.qwen2 import Qwen2ForCausalLM
from pagedserve.models.qwen3 import Qwen3ForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,  # Llama + optional sliding window on all layers
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "GlmForCausalLM": GlmForCausalLM,
    "Glm4ForCausalLM": Glm4ForCausalLM,
}


def supported_architectures() -> list[str]:
    """Hugging Face architecture names we can load, sorted."""
    return sorted(_MODELS)


def supported_gguf_architectures() -> list[str]:
    """GGUF ``general.architecture`` values we can load."""
    return list(GGUF_ARCHITECTURES)


def get_model_class(config) -> type[nn.Module]:
    """The class for ``config.architectures``; ``ValueError`` naming the supported ones if none fits."""
    archs = list(getattr(config, "architectures", None) or [])
    for arch in archs:
        if arch in _MODELS:
            return _MODELS[arch]
    model_type = getattr(config, "model_type", None)
    what = archs or f"unknown (config.json has no 'architectures'; model_type {model_type!r})"
    raise ValueError(
        f"unsupported model architecture {what}; "
        f"supported: {', '.join(supported_architectures())} "
        f"(GGUF: {', '.join(supported_gguf_architectures())})"
    )
