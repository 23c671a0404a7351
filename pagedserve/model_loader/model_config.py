"""``ModelConfig``: the model an engine serves, resolved once from its arguments."""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

import torch
import transformers

from pagedserve.args import EngineArgs
from pagedserve.config import resolve_device, resolve_dtype, resolve_kv_cache_dtype
from pagedserve.model_loader.files import load_config, resolve_model_path


@dataclass(frozen=True)
class ModelConfig:
    """Attributes:
        model_path: the checkpoint (a Hugging Face directory or a .gguf file).
        hf_config: its transformers config (the whole model's, not a rank's shard).
        device: ``cpu`` or ``cuda[:N]`` (``--device auto`` resolved).
        dtype: the model's compute dtype (``--dtype auto`` resolved for this device).
        kv_cache_dtype: the KV cache's dtype (``--kv-cache-dtype auto``: the model's).
        max_model_len: the longest sequence in tokens (``--max-model-len``, else the
            config's ``max_position_embeddings``).
    """

    model_path: pathlib.Path
    hf_config: transformers.PretrainedConfig
    device: str
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    max_model_len: int

    @classmethod
    def from_args(cls, args: EngineArgs, device: str | None = None) -> ModelConfig:
        """Resolve ``args`` (on ``device`` if given: a rank's own). Raises ``ValueError``
        for a bad dtype or device, ``FileNotFoundError`` for a missing model."""
        device = resolve_device(args.device) if device is None else device
        dtype = resolve_dtype(args.dtype, device)
        model_path = resolve_model_path(args.model)
        hf_config = load_config(model_path)
        return cls(model_path, hf_config, device, dtype,
                   resolve_kv_cache_dtype(args.kv_cache_dtype, dtype),
                   hf_config.max_position_embeddings if args.max_model_len is None
                   else args.max_model_len)
