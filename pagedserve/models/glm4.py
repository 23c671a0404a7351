"""GLM-4 (the ChatGLM line) as ported to Hugging Face: ``GlmForCausalLM``
(``modeling_glm.py``, GLM-4-9B) and ``Glm4ForCausalLM`` (``modeling_glm4.py``, GLM-4-0414).

Differences from Llama: partial rotary (``partial_rotary_factor``, 0.5) in the interleaved
(GPT-J) layout, q/k/v biases (``attention_bias``, on by default) but none on o, and the
checkpoint's gate/up projection already fused (``mlp.gate_up_proj``). GLM-4-0414 adds norms
after attention and after the MLP.
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from pagedserve.model_loader.files import partial_rotary_factor, rope_scaling, rope_theta
from pagedserve.models.layers import RotaryEmbedding
from pagedserve.models.llama import (
    AttentionOptions,
    LlamaForCausalLM,
    SandwichDecoderLayer,
    head_dim_of,
)


class GlmForCausalLM(LlamaForCausalLM):
    """GLM-4 decoder + LM head. Same constructor and shapes as ``LlamaForCausalLM``."""

    def attention_options(self, layer_idx: int) -> AttentionOptions:
        options = super().attention_options(layer_idx)
        return replace(options, qkv_bias=bool(getattr(self.config, "attention_bias", True)),
                       o_bias=False)

    def make_rotary(self, layer_idx: int) -> RotaryEmbedding:
        head_dim = head_dim_of(self.config)
        rotary_dim = int(head_dim * partial_rotary_factor(self.config, default=0.5))
        return self.shared_rotary(head_dim, rotary_dim, rope_theta(self.config),
                                  rope_scaling(self.config), interleaved=True)


class Glm4ForCausalLM(GlmForCausalLM):
    """GLM-4-0414: GLM plus ``post_self_attn_layernorm`` and ``post_mlp_layernorm``
    (``post_attention_layernorm`` is the norm before the MLP, as in Llama)."""

    def make_layer(self, layer_idx: int, backend) -> nn.Module:
        return SandwichDecoderLayer(
            self.config, backend, self.make_rotary(layer_idx), self.attention_options(layer_idx),
            self.norm_cls, ("input_layernorm", "post_self_attn_layernorm",
                            "post_attention_layernorm", "post_mlp_layernorm"))
