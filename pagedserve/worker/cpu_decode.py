"""The decoder layers of a Llama-family model in one C++ call for decode steps on CPU
(``torch.ops.pagedserve.llama_decode_layers``, ``csrc/decode_layers_cpu.cpp``).

Why: a lone request's decode step on CPU spent as long in Python (module calls, views,
~25 op dispatches a layer) as in reading its 4-bit weights. The C++ call runs the same
kernels in the same order, so its result is bit-equal to the Python layers (tested); it is
the CPU's counterpart of replaying a captured CUDA graph for decodes.

The final norm runs in the same call (fused with the last residual add, as between
layers): after the forward's streams of weights and K/V the caches are cold, and that norm,
called from Python, took ~0.11 ms of each step where the op alone takes 0.01.

It applies to models whose every layer is a plain ``LlamaDecoderLayer`` (RMSNorm, no biases,
no q/k norm, full-width neox rotary, SiLU) and whose final norm is an RMSNorm of the same
eps, with the C++ attention backend, in any dtype, whatever holds each projection's weight,
as long as its quantization method hands the step a kernel entry
(``LinearWeight.fused_kernel``: GGUF blocks, int8 rows or the float weight, each multiplied
as the method's ``apply`` does), LoRA adapters included (``lora/layers.py``: the same
grouped kernel adds their terms); and to steps whose sequences are all decodes. Other models
and steps run the Python layers. Measured on the shared workload (35 rows a step on
average): the step's Python took 14 of 101 ms with GGUF weights (benchmarks/README.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.attention import AttentionMetadata
from pagedserve.attention.cpu_attn import CpuAttention
from pagedserve.lora.layers import LoRAWeight
from pagedserve.models.layers import RMSNorm
from pagedserve.models.llama import LlamaDecoderLayer
from pagedserve.quantization.base import Linear


class CpuDecodeLayers:
    """A model's layer weights gathered for ``llama_decode_layers``; ``build`` makes one
    when the model qualifies (see the module docstring)."""

    def __init__(self, model) -> None:
        attn = model.layers[0].self_attn
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.head_dim, self.scale = attn.head_dim, attn.attn.scale
        self.eps = model.layers[0].input_layernorm.eps
        self.final_norm = model.norm.weight.detach()
        self.rotary = attn.rotary
        self.weights: list[torch.Tensor] = []
        self.kinds: list[int] = []
        self.windows = [layer.self_attn.attn.sliding_window or 0 for layer in model.layers]
        # LoRA: every projection's stack, and the batch whose token slots the step reads
        self.lora: list[torch.Tensor] = []
        self.lora_batch = None
        for layer in model.layers:
            qkv, o, gate_up, down = (p.method.fused_kernel(p) for p in _projections(layer))
            for p in _projections(layer):
                if isinstance(p.method, LoRAWeight):
                    self.lora += p.method.stack.kernel_tensors()
                    self.lora_batch = p.method.batch
            self.weights += [layer.input_layernorm.weight.detach(), *qkv[:2], *o[:2],
                             layer.post_attention_layernorm.weight.detach(), *gate_up[:2],
                             *down[:2]]
            self.kinds += [qkv[2], o[2], gate_up[2], down[2]]

    @classmethod
    def build(cls, model) -> CpuDecodeLayers | None:
        """One for ``model`` if every layer qualifies, else None."""

        def qualifies(layer) -> bool:
            if type(layer) is not LlamaDecoderLayer:
                return False
            a = layer.self_attn
            return (type(layer.input_layernorm) is RMSNorm
                    and type(layer.post_attention_layernorm) is RMSNorm
                    and a.q_norm is None and layer.mlp.act is F.silu
                    and a.rotary is model.layers[0].self_attn.rotary
                    and a.rotary.rotary_dim == a.head_dim and not a.rotary.interleaved
                    and isinstance(a.attn.backend, CpuAttention)
                    and all(isinstance(p, Linear) and p.bias is None
                            and p.method.fused_kernel(p) is not None
                            for p in _projections(layer)))

        if (len(model.layers) and all(qualifies(layer) for layer in model.layers)
                and type(model.norm) is RMSNorm
                and model.norm.eps == model.layers[0].input_layernorm.eps):
            return cls(model)
        return None

    @staticmethod
    def applies(meta: AttentionMetadata) -> bool:
        """A step whose sequences are all decodes."""
        return meta.num_decodes == meta.num_seqs

    def __call__(self, positions: torch.Tensor, hidden: torch.Tensor,
                 kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states ``[T, hidden_size]`` after every layer and the model's final
        norm (``hidden``, the residual stream, is updated in place)."""
        slots = None if self.lora_batch is None else self.lora_batch.slots
        return torch.ops.pagedserve.llama_decode_layers(
            hidden, positions, self.weights, self.final_norm, self.kinds, kv_caches, self.windows,
            meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            self.rotary.cos, self.rotary.sin, self.num_heads, self.num_kv_heads,
            self.head_dim, self.eps, self.scale, self.lora if slots is not None else [],
            _NO_SLOTS if slots is None else slots)


_NO_SLOTS = torch.empty(0, dtype=torch.int64)


def _projections(layer) -> list:
    a, mlp = layer.self_attn, layer.mlp
    return [a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj]
