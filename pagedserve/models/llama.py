"""The Llama architecture (Touvron et al. 2023) over a flat batch and the paged KV cache,
and the configurable decoder the other families build on.

Layout and weight names follow Hugging Face's ``modeling_llama.py`` so checkpoints load
directly; q/k/v and gate/up projections are fused into one matmul each at load time.
Projections and the LM head compute as their quantization method says
(``quantization/``).
Mistral (``modeling_mistral.py``) is this class: its optional ``sliding_window`` applies to
every layer. A family that differs overrides ``attention_options`` (biases, q/k norm,
window, scale), ``make_rotary`` and ``make_layer``, and sets ``norm_cls``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.attention import AttentionBackend, AttentionMetadata
from pagedserve.model_loader.files import rope_scaling, rope_theta
from pagedserve.models.layers import (
    Embedding,
    PagedAttention,
    RMSNorm,
    RotaryEmbedding,
    activation,
    silu_and_mul,
)
from pagedserve.quantization.base import Linear


def head_dim_of(config) -> int:
    """``config.head_dim``, else ``hidden_size // num_attention_heads``."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_sliding_window(config, layer_idx: int) -> int | None:
    """The attention window of one layer, or None for full attention.

    With ``config.layer_types`` (Qwen2/3, Gemma 3 in transformers 5) only
    ``"sliding_attention"`` layers slide; without it (Mistral) ``config.sliding_window``,
    when set, applies to every layer.
    """
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and layer_types[layer_idx] != "sliding_attention":
        return None
    return window


@dataclass(frozen=True)
class AttentionOptions:
    """What varies between families' attention blocks.

    Attributes:
        qkv_bias, o_bias: biases on the q/k/v and output projections.
        qk_norm: a norm class (``cls(head_dim, eps)``) applied per head to q and k before
            rotary (Qwen3, Gemma 3), or None.
        sliding_window: see ``layer_sliding_window``.
        scale: softmax scale; None means ``head_dim ** -0.5``.
    """

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: type[nn.Module] | None = None
    sliding_window: int | None = None
    scale: float | None = None


class LlamaAttention(nn.Module):
    """Self-attention over the paged cache: fused qkv projection, optional per-head q/k
    norm, rotary, paged attention, output projection. ``[T, hidden] -> [T, hidden]``."""

    def __init__(self, config, backend: AttentionBackend, rotary: RotaryEmbedding,
                 options: AttentionOptions = AttentionOptions()) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                               bias=options.qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=options.o_bias)
        self.q_norm = self.k_norm = None
        if options.qk_norm is not None:
            self.q_norm = options.qk_norm(self.head_dim, config.rms_norm_eps)
            self.k_norm = options.qk_norm(self.head_dim, config.rms_norm_eps)
        self.rotary = rotary
        scale = options.scale if options.scale is not None else self.head_dim**-0.5
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, scale,
                                   backend, options.sliding_window)

    def forward(self, positions, hidden, kv_cache, meta):
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))


class LlamaMLP(nn.Module):
    """Gated MLP ``down(act(gate(x)) * up(x))``, gate and up fused: SwiGLU with ``silu``,
    GeGLU with ``gelu_pytorch_tanh`` (Gemma). ``[T, hidden] -> [T, hidden]``."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu",
                 bias: bool = False) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.act = activation(act)
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        if self.act is F.silu:
            return self.down_proj(silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)


def make_mlp(config) -> LlamaMLP:
    """The family's MLP from ``hidden_act`` (or Gemma's ``hidden_activation``) and ``mlp_bias``."""
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    return LlamaMLP(config.hidden_size, config.intermediate_size, act,
                    bool(getattr(config, "mlp_bias", False)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``h += attn(norm(h)); h += mlp(norm(h))``."""

    def __init__(self, config, backend, rotary, options: AttentionOptions = AttentionOptions(),
                 norm_cls: type[nn.Module] = RMSNorm) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, backend, rotary, options)
        self.mlp = make_mlp(config)
        self.input_layernorm = norm_cls(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = norm_cls(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden, kv_cache, meta):
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden), kv_cache, meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class SandwichDecoderLayer(nn.Module):
    """Block with norms on both sides of attention and MLP (Gemma 2/3, GLM-4-0414):
    ``h += post_attn(attn(pre_attn(h))); h += post_mlp(mlp(pre_mlp(h)))``.

    ``norm_names`` gives the Hugging Face names of (pre_attn, post_attn, pre_mlp, post_mlp),
    which differ between families.
    """

    def __init__(self, config, backend, rotary, options: AttentionOptions,
                 norm_cls: type[nn.Module], norm_names: tuple[str, str, str, str]) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, backend, rotary, options)
        self.mlp = make_mlp(config)
        self.norm_names = norm_names
        for name in norm_names:
            setattr(self, name, norm_cls(config.hidden_size, config.rms_norm_eps))

    def forward(self, positions, hidden, kv_cache, meta):
        pre_attn, post_attn, pre_mlp, post_mlp = (getattr(self, n) for n in self.norm_names)
        hidden = hidden + post_attn(self.self_attn(positions, pre_attn(hidden), kv_cache, meta))
        return hidden + post_mlp(self.mlp(pre_mlp(hidden)))


# Hugging Face weight name fragment -> (our fused parameter, shard index).
_FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


def _num_shards(param_name: str) -> int:
    """How many checkpoint tensors fill a parameter (3 for q/k/v, 2 for gate/up)."""
    return 3 if "qkv_proj" in param_name else 2 if "gate_up_proj" in param_name else 1


def _shard_key(param_name: str, index: int) -> str:
    return f"{param_name}#{index}" if _num_shards(param_name) > 1 else param_name


class LlamaForCausalLM(nn.Module):
    """Llama decoder + LM head (HF ``modeling_llama.py``; also ``modeling_mistral.py``).

    Args:
        config: a transformers ``LlamaConfig`` (or any config with the same fields).
        backend: the paged attention backend.
        max_positions: size of the rotary cache (>= max_model_len).

    Subclasses customise through ``norm_cls``, ``attention_options``, ``make_rotary``,
    ``make_layer``, ``embed_scale`` and ``final_logit_softcapping``.
    """

    norm_cls: type[nn.Module] = RMSNorm

    def __init__(self, config, backend: AttentionBackend, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.max_positions = max_positions
        self.embed_scale: float | None = None
        self.final_logit_softcapping: float | None = None
        self._rotaries: dict[tuple, RotaryEmbedding] = {}
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            self.make_layer(i, backend) for i in range(config.num_hidden_layers)
        )
        self.norm = self.norm_cls(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False,
                              device="meta" if self.tie_word_embeddings else None)
        if self.tie_word_embeddings:  # the same parameter; a quantization method may give
            self.tie_lm_head()        # the head its own copy (int8 rows, GGUF blocks)
        # the fused decode step (worker/cpu_decode.py), set by the worker where it applies:
        # a callable (positions, hidden, kv_caches, meta) -> normed hidden, .applies(meta)
        self.cpu_decode = None

    # -- what families override ---------------------------------------------------------

    def attention_options(self, layer_idx: int) -> AttentionOptions:
        """Llama: ``attention_bias`` on q/k/v and o; window per ``layer_sliding_window``."""
        bias = bool(getattr(self.config, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias,
                                sliding_window=layer_sliding_window(self.config, layer_idx))

    def make_rotary(self, layer_idx: int) -> RotaryEmbedding:
        """Full-width neox rotary with the config's theta and scaling, shared by all layers."""
        head_dim = head_dim_of(self.config)
        return self.shared_rotary(head_dim, head_dim, rope_theta(self.config),
                                  rope_scaling(self.config))

    def make_layer(self, layer_idx: int, backend: AttentionBackend) -> nn.Module:
        """Decoder layer ``layer_idx``: ``forward(positions, hidden, kv_cache, meta)``."""
        return LlamaDecoderLayer(self.config, backend, self.make_rotary(layer_idx),
                                 self.attention_options(layer_idx), self.norm_cls)

    # -----------------------------------------------------------------------------------

    def shared_rotary(self, head_dim: int, rotary_dim: int, theta: float,
                      scaling: dict | None, interleaved: bool = False) -> RotaryEmbedding:
        """One ``RotaryEmbedding`` per distinct setting, shared by the layers that use it."""
        key = (head_dim, rotary_dim, theta, repr(scaling), interleaved)
        if key not in self._rotaries:
            self._rotaries[key] = RotaryEmbedding(head_dim, rotary_dim, self.max_positions,
                                                  theta, scaling, interleaved)
        return self._rotaries[key]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """Token ids and positions ``[T]`` -> final hidden states ``[T, hidden_size]``.

        ``kv_caches[i]`` is layer i's cache ``[2, num_blocks, block_size, kv_heads, head_dim]``.
        """
        hidden = self.embed_tokens(input_ids)
        if self.embed_scale is not None:  # Gemma: the scale is rounded to the weights' dtype
            # a CPU scalar: no host-to-device copy, which CUDA graph capture forbids
            scale = torch.tensor(self.embed_scale, dtype=hidden.dtype)
            hidden = hidden * scale
        if self.cpu_decode is not None and self.cpu_decode.applies(meta):
            return self.cpu_decode(positions, hidden, kv_caches, meta)  # final norm included
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden = layer(positions, hidden, kv_cache, meta)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[N, hidden_size]`` -> logits ``[N, vocab_size]`` in the LM head's
        dtype (soft-capped ``cap * tanh(logits / cap)`` where the model configures it). As
        vLLM's, the sampler widens them to float32 where it processes them."""
        logits = self.lm_head(hidden)
        if self.final_logit_softcapping:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the (fused) parameters. A checkpoint may
        hold q/k/v or gate/up separately or already fused (GLM's ``gate_up_proj``).

        Parameters that are not floating point hold what a quantization method took from
        the file before loading (``QuantizationMethod.take_stored_weights``): not loaded.

        Raises ``ValueError`` for an unexpected name or shape, or for parameters left unset.
        """
        params = {n: p for n, p in self.named_parameters() if p.is_floating_point()}
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
                    name, shard = name.replace(f".{hf_part}.", f".{ours}."), index
                    break
            if name not in params:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            param = params[name]
            target = param.data if shard is None else self._shard(name, param, shard)
            if target.shape != tensor.shape:
                raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
            target.copy_(tensor)
            shards = range(_num_shards(name)) if shard is None else [shard]
            loaded.update(_shard_key(name, i) for i in shards)
        expected = {_shard_key(n, i) for n in params for i in range(_num_shards(n))}
        missing = expected - loaded
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}")

    def tie_lm_head(self) -> None:
        """Make the LM head's weight the embedding's (again, after the embedding was
        replaced, e.g. by a tensor-parallel one)."""
        self.lm_head.weight = self.embed_tokens.weight

    def plain_pre_norm_layers(self) -> list[LlamaDecoderLayer] | None:
        """The decoder layers if every one is a plain pre-norm ``LlamaDecoderLayer`` with
        ``RMSNorm`` (whose norm weights scale the channels its qkv and gate/up projections
        read: what SmoothQuant folds into), else None."""
        layers = list(self.layers)
        plain = len(layers) > 0 and all(
            type(layer) is LlamaDecoderLayer and type(layer.input_layernorm) is RMSNorm
            and type(layer.post_attention_layernorm) is RMSNorm for layer in layers)
        return layers if plain else None

    def checkpoint_names(self, module_name: str) -> list[str]:
        """The checkpoint modules one of ours is made of, in row order:
        ``layers.0.self_attn.qkv_proj`` -> ``layers.0.self_attn.{q,k,v}_proj``,
        ``...mlp.gate_up_proj`` -> ``...mlp.{gate,up}_proj``, a tied ``lm_head`` ->
        ``embed_tokens``; others -> themselves."""
        if module_name == "lm_head" and self.tie_word_embeddings:
            return ["embed_tokens"]
        *parent, leaf = module_name.split(".")
        shards = sorted((index, hf) for hf, (ours, index) in _FUSED.items() if ours == leaf)
        return [".".join([*parent, hf]) for _, hf in shards] or [module_name]

    def _shard(self, name: str, param: torch.Tensor, index: int) -> torch.Tensor:
        if "qkv_proj" in name:
            attn = self.layers[0].self_attn
            sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        else:
            sizes = [self.config.intermediate_size] * 2
        start = sum(sizes[:index])
        return param.data[start : start + sizes[index]]
