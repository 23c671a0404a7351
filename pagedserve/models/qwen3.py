"""Qwen3 (HF ``modeling_qwen3.py``): Llama with an RMSNorm over each head's q and k
before rotary, biases only where ``attention_bias`` says (none in released models), and the
same optional per-layer sliding window as Qwen2."""

from __future__ import annotations

from dataclasses import replace

from pagedserve.models.layers import RMSNorm
from pagedserve.models.llama import AttentionOptions, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 decoder + LM head. Same constructor and shapes as ``LlamaForCausalLM``;
    adds ``self_attn.q_norm`` / ``k_norm`` weights ``[head_dim]`` per layer."""

    def attention_options(self, layer_idx: int) -> AttentionOptions:
        return replace(super().attention_options(layer_idx), qk_norm=RMSNorm)
