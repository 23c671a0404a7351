"""Maps Hugging Face ``architectures`` names to our model classes."""

from __future__ import annotations

from torch import nn

from pagedserve.models.llama import LlamaForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(config) -> type[nn.Module]:
    """The class for ``config.architectures``; ``ValueError`` naming the supported ones if none fits."""
    archs = list(getattr(config, "architectures", None) or [])
    for arch in archs:
        if arch in _MODELS:
            return _MODELS[arch]
    raise ValueError(
        f"unsupported model architecture {archs or 'unknown'}; "
        f"supported: {', '.join(supported_architectures())}"
    )
