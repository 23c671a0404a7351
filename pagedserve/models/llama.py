"""The Llama architecture (Touvron et al. 2023) over a flat batch and the paged KV cache.

Layout and weight names follow Hugging Face's ``modeling_llama.py`` so checkpoints load
directly; q/k/v and gate/up projections are fused into one matmul each at load time.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.attention import AttentionBackend, AttentionMetadata
from pagedserve.models.layers import PagedAttention, RMSNorm, RotaryEmbedding
from pagedserve.models.loader import rope_scaling, rope_theta


class LlamaAttention(nn.Module):
    def __init__(self, config, backend: AttentionBackend, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = getattr(config, "attention_bias", False)
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=bias)
        self.rotary = rotary
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim,
                                   self.head_dim**-0.5, backend)

    def forward(self, positions, hidden, kv_cache, meta):
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))


class LlamaMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``, gate and up fused."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, backend, rotary) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, backend, rotary)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, kv_cache, meta):
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden), kv_cache, meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


# Hugging Face weight name fragment -> (our fused parameter, shard index).
_FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


def _num_shards(param_name: str) -> int:
    """How many checkpoint tensors fill a parameter (3 for q/k/v, 2 for gate/up)."""
    return 3 if "qkv_proj" in param_name else 2 if "gate_up_proj" in param_name else 1


class LlamaForCausalLM(nn.Module):
    """Llama decoder + LM head.

    Args:
        config: a transformers ``LlamaConfig`` (or any config with the same fields).
        backend: the paged attention backend.
        max_positions: size of the rotary cache (>= max_model_len).
    """

    def __init__(self, config, backend: AttentionBackend, max_positions: int) -> None:
        super().__init__()
        self.config = config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rotary = RotaryEmbedding(head_dim, head_dim, max_positions, rope_theta(config),
                                 rope_scaling(config))
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, backend, rotary) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """Token ids and positions ``[T]`` -> final hidden states ``[T, hidden_size]``.

        ``kv_caches[i]`` is layer i's cache ``[2, num_blocks, block_size, kv_heads, head_dim]``.
        """
        hidden = self.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden = layer(positions, hidden, kv_cache, meta)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[N, hidden_size]`` -> float32 logits ``[N, vocab_size]``."""
        weight = self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the (fused) parameters.

        Raises ``ValueError`` for an unexpected name or shape, or for parameters left unset.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            shard = None
            for hf_part, (ours, index) in _FUSED.items():
                if f".{hf_part}." in name:
                    name, shard = name.replace(hf_part, ours), index
                    break
            if name not in params:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            param = params[name]
            target = param.data if shard is None else self._shard(name, param, shard)
            if target.shape != tensor.shape:
                raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
            target.copy_(tensor)
            loaded.add(name if shard is None else f"{name}#{shard}")
        expected = {
            f"{n}#{i}" if _num_shards(n) > 1 else n for n in params for i in range(_num_shards(n))
        }
        missing = expected - loaded
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}")

    def _shard(self, name: str, param: torch.Tensor, index: int) -> torch.Tensor:
        if "qkv_proj" in name:
            attn = self.layers[0].self_attn
            sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        else:
            sizes = [self.config.intermediate_size] * 2
        start = sum(sizes[:index])
        return param.data[start : start + sizes[index]]
