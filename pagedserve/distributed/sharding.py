"""Megatron-style tensor parallelism (Shoeybi et al. 2019) applied to the existing models.

A rank builds the unchanged model class from a *local* config (``shard_config``: its share
of the heads, MLP rows and vocabulary), reads the checkpoint through ``shard_weights`` (each
full tensor is sliced as it is read, so no rank holds the whole model), and
``make_tensor_parallel`` adds the collectives:

- q/k/v and gate/up are column-parallel: rank r keeps the rows of its heads / MLP rows, so
  its attention and MLP run on its shard alone, with no communication;
- o_proj and down_proj are row-parallel: rank r keeps the matching columns and produces a
  partial sum, completed by one all-reduce each (a forward hook; bias on rank 0 only);
- the embedding and the LM head are vocabulary-parallel: rank r holds vocabulary rows
  ``[r * V', (r + 1) * V')`` (``V' = ceil(V / tp)``, zero-padded); looked-up rows are summed
  over ranks, and the logits are gathered on the driver.

KV heads are split like q heads; where a model has fewer KV heads than ranks (Gemma 3 270M
has one), each KV head is replicated on ``tp / num_kv_heads`` ranks, the ranks whose q heads
read it. Example, 4 q heads, 1 KV head, tp 2: rank 0 has q heads 0-1 and KV head 0; rank 1
has q heads 2-3 and KV head 0.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.distributed.group import RankGroup
from pagedserve.models.llama import head_dim_of


def _heads(config) -> tuple[int, int]:
    heads = config.num_attention_heads
    return heads, getattr(config, "num_key_value_heads", None) or heads


def check_tensor_parallel(config, tp: int) -> None:
    """Raise ``ValueError`` (naming both numbers) if the model cannot be split over ``tp``
    ranks: ``tp`` must divide the attention heads and the MLP width, and the KV heads must
    divide ``tp`` or be divisible by it. One rank holds any model."""
    if tp == 1:
        return
    heads, kv_heads = _heads(config)
    if heads % tp:
        raise ValueError(f"tensor_parallel_size {tp} does not divide the model's {heads} "
                         "attention heads")
    if (kv_heads % tp if kv_heads >= tp else tp % kv_heads):
        raise ValueError(f"tensor_parallel_size {tp} and the model's {kv_heads} KV heads: "
                         "one must divide the other")
    if config.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size {tp} does not divide the model's "
                         f"intermediate_size {config.intermediate_size}")


def local_vocab_size(vocab_size: int, tp: int) -> int:
    """Vocabulary rows per rank: ``ceil(vocab_size / tp)`` (the last rank's are padded)."""
    return -(-vocab_size // tp)


def shard_config(config, tp: int):
    """A copy of ``config`` with one rank's share of heads, KV heads (at least one), MLP
    width and vocabulary; ``head_dim`` is set explicitly (it no longer follows from
    ``hidden_size / heads``). ``tp == 1`` returns ``config`` itself."""
    if tp == 1:
        return config
    check_tensor_parallel(config, tp)
    heads, kv_heads = _heads(config)
    local = copy.deepcopy(config)
    local.head_dim = head_dim_of(config)
    local.num_attention_heads = heads // tp
    local.num_key_value_heads = max(kv_heads // tp, 1)
    local.intermediate_size = config.intermediate_size // tp
    local.vocab_size = local_vocab_size(config.vocab_size, tp)
    return local


def kv_head_range(config, rank: int, tp: int) -> tuple[int, int]:
    """``(first, count)`` of the KV heads rank ``rank`` holds (see the module docstring)."""
    _, kv_heads = _heads(config)
    if kv_heads >= tp:
        return rank * (kv_heads // tp), kv_heads // tp
    return rank // (tp // kv_heads), 1


def shard_weights(weights: Iterable[tuple[str, torch.Tensor]], config, rank: int, tp: int
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """Rank ``rank``'s slice of every Hugging Face-named checkpoint tensor (``config`` is the
    full model's). Each slice is a copy, so the full tensor is freed once read."""
    for name, tensor in weights:
        yield name, _shard_tensor(name, tensor, config, rank, tp)


def _shard_tensor(name: str, t: torch.Tensor, config, rank: int, tp: int) -> torch.Tensor:
    parts = name.split(".")
    module, kind = (parts[-2] if len(parts) > 1 else ""), parts[-1]
    heads, _ = _heads(config)
    head_dim = head_dim_of(config)
    width = config.intermediate_size // tp
    if module == "q_proj":
        n = heads // tp * head_dim
        return t[rank * n : (rank + 1) * n].clone()
    if module in ("k_proj", "v_proj"):
        first, count = kv_head_range(config, rank, tp)
        return t[first * head_dim : (first + count) * head_dim].clone()
    if module in ("gate_proj", "up_proj"):
        return t[rank * width : (rank + 1) * width].clone()
    if module == "gate_up_proj":  # fused in the checkpoint (GLM): [gate; up]
        gate, up = t.chunk(2)
        return torch.cat([gate[rank * width : (rank + 1) * width],
                          up[rank * width : (rank + 1) * width]])
    if module in ("o_proj", "down_proj"):
        if kind == "bias":  # added once: by rank 0 before the all-reduce
            return t.clone() if rank == 0 else torch.zeros_like(t)
        n = t.shape[1] // tp
        return t[:, rank * n : (rank + 1) * n].clone()
    if module in ("embed_tokens", "lm_head"):
        n = local_vocab_size(config.vocab_size, tp)
        rows = t[rank * n : (rank + 1) * n]
        return torch.cat([rows, rows.new_zeros(n - rows.shape[0], *rows.shape[1:])])
    return t


class VocabParallelEmbedding(nn.Embedding):
    """Rows ``[start, start + num_embeddings)`` of the vocabulary; ids outside give zero
    rows, and the all-reduce over ranks completes every row. ``[T] -> [T, hidden]``."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group: RankGroup) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.start = group.rank * num_embeddings
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        inside = (local >= 0) & (local < self.num_embeddings)
        rows = F.embedding(torch.where(inside, local, 0), self.weight)
        return self.group.all_reduce(rows * inside[:, None].to(rows.dtype))


class TensorParallelModel(nn.Module):
    """One rank's shard of a model: ``forward`` as the model's (hidden states replicated on
    every rank); ``compute_logits`` gathers the vocabulary shards on the driver.

    Args:
        model: the model built from ``shard_config`` (its embedding already a
            ``VocabParallelEmbedding``, see ``make_tensor_parallel``).
        group: this rank's group.
        vocab_size: the full model's vocabulary size (padding columns are dropped).
    """

    def __init__(self, model: nn.Module, group: RankGroup, vocab_size: int) -> None:
        super().__init__()
        self.model = model
        self.group = group
        self.vocab_size = vocab_size

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        """As the model's: ``[T]`` ids and positions -> hidden states ``[T, hidden_size]``."""
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Hidden ``[N, hidden_size]`` -> logits ``[N, vocab_size]`` (the model's dtype) on
        the driver, None on the other ranks."""
        logits = self.group.gather_last_dim(self.model.compute_logits(hidden))
        return None if logits is None else logits[:, : self.vocab_size]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.model.load_weights(weights)


def make_tensor_parallel(model: nn.Module, group: RankGroup, vocab_size: int
                         ) -> TensorParallelModel:
    """Add the collectives to a model built from ``shard_config``, before its weights are
    loaded: a ``VocabParallelEmbedding`` in place of ``embed_tokens`` (same parameter name
    and shape) and an all-reduce after every ``o_proj`` and ``down_proj``."""
    old = model.embed_tokens
    model.embed_tokens = VocabParallelEmbedding(old.num_embeddings, old.embedding_dim, group
                                                ).to(old.weight.device, old.weight.dtype)
    if model.tie_word_embeddings:
        model.tie_lm_head()
    for name, module in model.named_modules():
        if name.split(".")[-1] in ("o_proj", "down_proj"):
            module.register_forward_hook(lambda _m, _inputs, out: group.all_reduce(out))
    return TensorParallelModel(model, group, vocab_size)
