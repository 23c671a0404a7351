"""The LoRA term inside the model: per projection a stack of ``max_loras`` adapter slots,
and a ``LinearWeight`` that adds the term of each row's slot to whatever computes the base
product (float, GGUF blocks, int8 rows).

For a step, every token row has a slot (``LoRABatch.slots``, -1: no adapter); one grouped
call per projection adds ``(x @ A[s]^T) @ Bt[s]`` to each row of slot ``s``: on CPU our C++
kernel (``csrc/lora_cpu.cpp``, the counterpart of Punica's SGMV; one fixed-order chain per
output element, so a row gets the same bits alone as in any batch), elsewhere PyTorch
products per slot. The model code knows nothing of requests: the worker's
``LoRAManager`` fills the slots and sets ``LoRABatch.slots`` before each forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedserve.cpu_ops import cpu_layer_ops
from pagedserve.lora.adapter import LoRATarget, ProjectionLoRA
from pagedserve.quantization.base import Linear, LinearWeight


class LoRABatch:
    """The step's token slots, shared by every LoRA layer of a model.

    ``slots``: ``[num_tokens]`` int64 on the model's device, each token's adapter slot or
    -1; None when no token of the step uses an adapter (the layers then add nothing).
    """

    def __init__(self) -> None:
        self.slots: torch.Tensor | None = None


class LoRAStack:
    """One projection's adapter slots.

    Attributes:
        a: ``[max_loras, num_shards * max_rank, K]`` in ``dtype`` (``--lora-dtype``).
        bt: ``[max_loras, max_rank, N]`` in ``dtype`` (scale folded in).
        ranks: ``[max_loras]`` int64: the rank used in each slot (0: empty).
        shard_cols: ``[num_shards + 1]`` int64 column boundaries of the fused shards.
    """

    def __init__(self, target: LoRATarget, max_loras: int, max_rank: int,
                 device: torch.device, dtype: torch.dtype = torch.float32) -> None:
        shards = len(target.shard_sizes)
        self.target = target
        self.max_rank = max_rank
        self.a = torch.zeros(max_loras, shards * max_rank, target.in_features, device=device,
                             dtype=dtype)
        self.bt = torch.zeros(max_loras, max_rank, target.out_features, device=device,
                              dtype=dtype)
        self.ranks = torch.zeros(max_loras, dtype=torch.int64, device=device)
        self.shard_cols = torch.tensor(target.shard_cols(), dtype=torch.int64, device=device)

    def set_slot(self, slot: int, lora: ProjectionLoRA | None) -> None:
        """Put ``lora`` into ``slot`` (zeros and rank 0 for None: the adapter leaves this
        projection alone)."""
        self.a[slot].zero_()
        self.bt[slot].zero_()
        if lora is None:
            self.ranks[slot] = 0
            return
        r, shards = lora.rank, len(self.target.shard_sizes)
        for i in range(shards):
            self.a[slot, i * self.max_rank : i * self.max_rank + r] = lora.a[i * r : (i + 1) * r]
        self.bt[slot, :r] = lora.bt
        self.ranks[slot] = r

    def kernel_tensors(self) -> list[torch.Tensor]:
        """``[a, bt, ranks, shard_cols]``: the arguments of ``lora_add`` after the slots."""
        return [self.a, self.bt, self.ranks, self.shard_cols]

    def add(self, out: torch.Tensor, x: torch.Tensor, slots: torch.Tensor) -> None:
        """``out [T, N] += (x [T, K] @ A[s]^T) @ Bt[s]`` for each row's slot ``s`` (-1:
        nothing), in place."""
        ops = cpu_layer_ops(x)
        kernel_dtypes = (torch.float32, torch.bfloat16)
        if ops is not None and out.dtype in kernel_dtypes and self.a.dtype in kernel_dtypes:
            ops.lora_add(out, x, slots, *self.kernel_tensors())
            return
        cols = self.target.shard_cols()
        for slot in slots.unique().tolist():
            rank = int(self.ranks[slot]) if slot >= 0 else 0
            if rank == 0:
                continue
            rows = (slots == slot).nonzero().squeeze(1)
            xs = x[rows].float()
            delta = torch.empty(len(rows), out.shape[1], device=out.device)
            for i in range(len(cols) - 1):
                a = self.a[slot, i * self.max_rank : i * self.max_rank + rank].float()
                bt = self.bt[slot, :rank, cols[i] : cols[i + 1]].float()
                delta[:, cols[i] : cols[i + 1]] = (xs @ a.t()) @ bt
            out.index_add_(0, rows, delta.to(out.dtype))


@dataclass(frozen=True)
class LoRAWeight:
    """A ``LinearWeight`` of base + LoRA: ``base.apply`` then the slot terms of the rows
    (``LoRAStack.add``). The fused CPU decode step multiplies the base through
    ``fused_kernel`` and adds the same term with the same kernel."""

    base: LinearWeight
    stack: LoRAStack
    batch: LoRABatch

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        out = self.base.apply(layer, x)
        slots = self.batch.slots
        if slots is not None:
            width = x.shape[-1]
            self.stack.add(out.view(-1, out.shape[-1]), x.reshape(-1, width), slots)
        return out

    def fused_kernel(self, layer: Linear):
        return self.base.fused_kernel(layer)


def lora_targets(model: nn.Module) -> list[LoRATarget]:
    """The projections of ``model``'s decoder layers an adapter may target: q/k/v (fused
    ``qkv_proj``), o, gate/up (fused ``gate_up_proj``) and down, named as the model's
    ``checkpoint_names`` gives them."""
    targets = []
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        prefix = f"layers.{i}"
        for name, module, sizes in (
            ("self_attn.qkv_proj", attn.qkv_proj, (attn.q_size, attn.kv_size, attn.kv_size)),
            ("self_attn.o_proj", attn.o_proj, (attn.o_proj.out_features,)),
            ("mlp.gate_up_proj", mlp.gate_up_proj, (mlp.intermediate_size,) * 2),
            ("mlp.down_proj", mlp.down_proj, (mlp.down_proj.out_features,)),
        ):
            full = f"{prefix}.{name}"
            targets.append(LoRATarget(full, module.in_features,
                                      tuple(model.checkpoint_names(full)), sizes))
    return targets


def add_lora_layers(model: nn.Module, max_loras: int, max_rank: int,
                    dtype: torch.dtype = torch.float32
                    ) -> tuple[LoRABatch, dict[str, LoRAStack]]:
    """Give every targetable projection of ``model`` a ``LoRAWeight`` over the method it
    already holds (call after the quantization method processed the model, before the
    fused decode step is built); the stacks hold the adapters in ``dtype``. Returns the
    shared batch and the stacks by module name."""
    batch = LoRABatch()
    stacks = {}
    modules = dict(model.named_modules())
    device = model.norm.weight.device
    for target in lora_targets(model):
        layer = modules[target.module]
        stack = LoRAStack(target, max_loras, max_rank, device, dtype)
        layer.method = LoRAWeight(layer.method, stack, batch)
        stacks[target.module] = stack
    return batch, stacks
