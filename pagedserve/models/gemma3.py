"""Gemma 3 text models (HF ``modeling_gemma3.py``, ``Gemma3ForCausalLM``).

Differences from Llama: local sliding-window layers interleaved with global ones
(``config.layer_types``; 5 local : 1 global), each kind with its own rope base
(``rope_parameters["sliding_attention"]`` / ``["full_attention"]``, 10k / 1M); RMSNorm
``x * (1 + w)``; a q/k norm per head; softmax scale ``query_pre_attn_scalar ** -0.5``;
GeGLU MLP; norms before and after both attention and MLP; embeddings scaled by
``sqrt(hidden_size)``; optional final logit soft-capping; tied embeddings.
"""

from __future__ import annotations

from types import SimpleNamespace

from torch import nn

from pagedserve.model_loader.files import rope_scaling, rope_theta
from pagedserve.models.layers import GemmaRMSNorm, RotaryEmbedding
from pagedserve.models.llama import (
    AttentionOptions,
    LlamaForCausalLM,
    SandwichDecoderLayer,
    head_dim_of,
    layer_sliding_window,
)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3 decoder + LM head. Same constructor and shapes as ``LlamaForCausalLM``.

    Raises ``ValueError`` for what the paged attention path does not do: attention logit
    soft-capping and bidirectional attention (EmbeddingGemma).
    """

    norm_cls = GemmaRMSNorm

    def __init__(self, config, backend, max_positions: int) -> None:
        if getattr(config, "attn_logit_softcapping", None) is not None:
            raise ValueError("Gemma 3 with attn_logit_softcapping is not supported")
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("Gemma 3 with use_bidirectional_attention is not supported")
        super().__init__(config, backend, max_positions)
        self.embed_scale = config.hidden_size**0.5
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)

    def attention_options(self, layer_idx: int) -> AttentionOptions:
        bias = bool(getattr(self.config, "attention_bias", False))
        return AttentionOptions(
            qkv_bias=bias, o_bias=bias, qk_norm=GemmaRMSNorm,
            sliding_window=layer_sliding_window(self.config, layer_idx),
            scale=self.config.query_pre_attn_scalar**-0.5)

    def make_rotary(self, layer_idx: int) -> RotaryEmbedding:
        """Rope of the layer's type: ``rope_parameters`` holds one dict per layer type."""
        params = SimpleNamespace(rope_parameters=self.config.rope_parameters[
            self.config.layer_types[layer_idx]])
        head_dim = head_dim_of(self.config)
        return self.shared_rotary(head_dim, head_dim, rope_theta(params), rope_scaling(params))

    def make_layer(self, layer_idx: int, backend) -> nn.Module:
        return SandwichDecoderLayer(
            self.config, backend, self.make_rotary(layer_idx), self.attention_options(layer_idx),
            self.norm_cls, ("input_layernorm", "post_attention_layernorm",
                            "pre_feedforward_layernorm", "post_feedforward_layernorm"))
