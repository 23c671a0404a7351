"""What a quantization method is, and the ``Linear`` layer that asks it.

As vLLM's ``QuantizationConfig`` / ``LinearMethodBase`` (``vllm/model_executor/layers/
quantization/base_config.py``), in two parts:

- a ``QuantizationMethod`` (one per engine, chosen by the registry in ``__init__.py``)
  turns a model's loaded float weights into what its linear layers hold
  (``process_model``);
- each ``Linear`` then holds a ``LinearWeight`` (its ``method`` attribute): an object of
  that method which computes the layer's product (``apply``) and hands the fused C++
  decode step its kernel entry (``fused_kernel``).

A new method is a module here with its ``QuantizationMethod`` and ``LinearWeight``, plus
one line in the registry; nothing in the models, the worker or the engine changes.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

# Kinds of projection the fused C++ decode step (csrc/decode_layers_cpu.cpp) multiplies,
# besides a GGUF type id (>= 0): int8 rows + scales, or a float weight (+ packed copy).
KIND_INT8, KIND_FLOAT = -1, -2
EMPTY = torch.empty(0)  # the second tensor of a kernel entry that has none


class LinearWeight(Protocol):
    """How one ``Linear`` holds its weight and multiplies by it."""

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K] -> [..., N]`` = ``x @ W.T + bias`` as this method computes it."""

    def fused_kernel(self, layer: Linear) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """``(a, b, kind)`` for ``llama_decode_layers`` (a kind above: a GGUF type id,
        ``KIND_INT8`` or ``KIND_FLOAT``), or None when the C++ step has no kernel for it
        (then the model's steps run the Python layers)."""


@dataclass(frozen=True)
class PlainWeight:
    """The layer's float weight by ``F.linear``: what a ``Linear`` holds until a method
    processes it (models built outside an engine, autograd in tests)."""

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)

    def fused_kernel(self, layer: Linear) -> tuple[torch.Tensor, torch.Tensor, int]:
        return layer.weight.detach(), EMPTY, KIND_FLOAT


class Linear(nn.Linear):
    """``nn.Linear`` whose product is computed by its ``method`` (a ``LinearWeight``)."""

    method: LinearWeight = PlainWeight()

    def reset_parameters(self) -> None:
        """No random initialization: ``load_weights`` overwrites every weight (and raises
        for one left unset), ``load_format="dummy"`` fills them itself. Initializing
        SmolLM2's 120 Linears took ~1 s of start-up for values thrown away."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)


@dataclass(frozen=True)
class LoadContext:
    """What a method may need while it processes a loaded model.

    Attributes:
        model_path: the checkpoint (a GGUF file keeps blocks a method can read).
        device, dtype: where and in what the model computes.
        max_model_len: the longest sequence (in tokens) the model's rotary tables hold.
        tokenizer: returns the model's tokenizer (loading it if the engine has none),
            for calibration text.
        prefill: runs the model over one prompt's token ids (a scratch KV cache), or None
            where a rank cannot run a forward pass alone (tensor parallel).
    """

    model_path: pathlib.Path
    device: str
    dtype: torch.dtype
    max_model_len: int
    tokenizer: Callable[[], object]
    prefill: Callable[[list[int]], None] | None


class QuantizationMethod:
    """A method as the registry holds it. ``name`` is the ``--quantization`` value;
    ``cpu_only``: it computes on CPU only; ``needs_cpu_ops``: only with our C++ kernels."""

    name: str
    cpu_only = False
    needs_cpu_ops = False

    def take_stored_weights(self, model: nn.Module, ctx: LoadContext) -> set[str]:
        """Before the checkpoint's float weights load: give the modules that compute from
        weights the file stores as they are (GGUF blocks) those weights now, as parameters
        that are not floating point, and return the checkpoint tensors taken (HF names),
        which the loader then never reads into float. None by default."""
        return set()

    def process_model(self, model: nn.Module, ctx: LoadContext) -> str:
        """Give each ``Linear`` of the loaded ``model`` its ``LinearWeight``; returns one
        line for the start-up log saying what the layers now hold."""
        raise NotImplementedError


def linears(model: nn.Module) -> list[tuple[str, Linear]]:
    """Every ``Linear`` of ``model`` with its name; a tied LM head (the embedding's
    weight) once, under ``lm_head``."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, Linear)]
