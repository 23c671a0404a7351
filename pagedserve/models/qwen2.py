"""Qwen2 / Qwen2.5 (HF ``modeling_qwen2.py``): Llama with biases on the q/k/v projections
(none on o), and an optional sliding window on the layers ``config.layer_types`` marks
(``use_sliding_window``: layers from ``max_window_layers`` on)."""

from __future__ import annotations

from dataclasses import replace

from pagedserve.models.llama import AttentionOptions, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 decoder + LM head (tied to the embeddings in the small models).

    Same constructor and shapes as ``LlamaForCausalLM``.
    """

    def attention_options(self, layer_idx: int) -> AttentionOptions:
        return replace(super().attention_options(layer_idx), qkv_bias=True, o_bias=False)
