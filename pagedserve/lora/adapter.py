"""Read a PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``, as
``PeftModel.save_pretrained`` writes them) into the layout of our fused projections, and
refuse, by name, what we do not serve.

A LoRA (Hu et al. 2021) adds ``x @ A^T @ B^T * scale`` to a projection ``x @ W^T``, with
``A [r, K]``, ``B [N, r]`` and ``scale = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with
``use_rslora``, Kalajdzievski 2023), as PEFT's ``tuners/lora/layer.py``; ``rank_pattern``
and ``alpha_pattern`` override ``r`` and ``lora_alpha`` per module, matched as PEFT's
``get_pattern_key`` matches them (``(.*\\.)?(pattern)$`` on the module's name).

Our q/k/v and gate/up projections are fused (``models/llama.py``): an adapter's
``q_proj``, ``k_proj`` and ``v_proj`` become the shards of one ``ProjectionLoRA`` of
``qkv_proj``. Loading is a pure function of the files and the model's shapes
(``LoRATarget``), so the server runs it off the engine thread.
"""

from __future__ import annotations

import json
import math
import pathlib
import re
from dataclasses import dataclass

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


@dataclass(frozen=True)
class LoRATarget:
    """One of our projections an adapter may target.

    Attributes:
        module: our module's name (``layers.0.self_attn.qkv_proj``).
        in_features: K.
        shard_names: the checkpoint modules it fuses, in row order
            (``layers.0.self_attn.q_proj``, ...); one name when not fused.
        shard_sizes: their output rows (N of each shard).
    """

    module: str
    in_features: int
    shard_names: tuple[str, ...]
    shard_sizes: tuple[int, ...]

    @property
    def out_features(self) -> int:
        return sum(self.shard_sizes)

    def shard_cols(self) -> list[int]:
        """Column boundaries of the shards in the output: ``[0, n0, n0 + n1, ...]``."""
        cols = [0]
        for size in self.shard_sizes:
            cols.append(cols[-1] + size)
        return cols


@dataclass
class ProjectionLoRA:
    """An adapter's term on one projection, in the kernel's layout (``layers.py``).

    Attributes:
        a: ``[num_shards * rank, K]`` float32: shard i's A in rows ``[i * rank, (i+1) * rank)``
            (zero rows pad a shard of lower rank, or one the adapter does not target).
        bt: ``[rank, N]`` float32: ``(B * scale)^T`` of the shard that owns each column.
        rank: the largest rank among the shards.
    """

    a: torch.Tensor
    bt: torch.Tensor
    rank: int


@dataclass
class LoRAAdapter:
    """A loaded adapter: its term per targeted projection (our module names)."""

    name: str
    path: str
    projections: dict[str, ProjectionLoRA]


def load_adapter(name: str, path: str, targets: list[LoRATarget], max_rank: int
                 ) -> LoRAAdapter:
    """Read the PEFT adapter in directory ``path`` for a model whose projections are
    ``targets``.

    Raises ``ValueError`` naming the problem: a missing directory or file, a config we do
    not serve (not LoRA, ``use_dora``, ``modules_to_save``, a ``bias`` other than
    ``"none"``, ``fan_in_fan_out``), a tensor that is not a ``lora_A`` / ``lora_B``
    weight, a module the model does not have, a rank above ``max_rank``, or shapes of
    another base model.
    """
    folder = pathlib.Path(path)
    where = f"LoRA adapter {name!r} ({path})"
    if not folder.is_dir():
        raise ValueError(f"{where}: no such directory")
    config = _read_config(folder / CONFIG_FILE, where)
    tensors = _read_tensors(folder, where)
    pairs = _pair_tensors(tensors, where)
    by_shard = {shard: (t, i) for t in targets for i, shard in enumerate(t.shard_names)}
    by_module = {t.module: t for t in targets}
    per_target: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor, float]]] = {}
    for module, (a, b) in pairs.items():
        if module in by_shard:
            target, index = by_shard[module]
            shards = [index]
        elif module in by_module:  # an adapter on a projection the checkpoint fuses too
            target = by_module[module]
            shards = list(range(len(target.shard_names)))
        else:
            known = sorted({n.rsplit(".", 1)[-1] for t in targets for n in t.shard_names})
            raise ValueError(f"{where}: target module {module!r} is not a projection of this "
                             f"model (LoRA applies to {', '.join(known)})")
        rank = a.shape[0]
        _check_shapes(where, module, a, b, target, shards, max_rank)
        scale = _scale(config, module, rank)
        cols = target.shard_cols()  # b's rows: the output columns of shards[0] onwards
        for i in shards:
            b_shard = b[cols[i] - cols[shards[0]] : cols[i + 1] - cols[shards[0]]]
            per_target.setdefault(target.module, {})[i] = (a.float(), b_shard.float(), scale)
    projections = {module: _fuse(by_module[module], shards)
                   for module, shards in per_target.items()}
    if not projections:
        raise ValueError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    return LoRAAdapter(name, str(path), projections)


def _read_config(file: pathlib.Path, where: str) -> dict:
    if not file.is_file():
        raise ValueError(f"{where}: no {CONFIG_FILE}")
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: {CONFIG_FILE} is not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise ValueError(f"{where}: {CONFIG_FILE} is not a JSON object")  # noqa: TRY004 - bad input
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise ValueError(f"{where}: peft_type {peft_type!r} is not served (only LORA)")
    if config.get("use_dora"):
        raise ValueError(f"{where}: use_dora (DoRA) is not supported")
    if config.get("modules_to_save"):
        raise ValueError(f"{where}: modules_to_save is not supported "
                         f"({config['modules_to_save']})")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{where}: bias {config['bias']!r} is not supported (only \"none\")")
    if config.get("lora_bias"):
        raise ValueError(f"{where}: lora_bias is not supported")
    if config.get("fan_in_fan_out"):
        raise ValueError(f"{where}: fan_in_fan_out is not supported")
    if "lora_alpha" not in config or "r" not in config:
        raise ValueError(f"{where}: {CONFIG_FILE} lacks r or lora_alpha")
    return config


def _read_tensors(folder: pathlib.Path, where: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = folder / WEIGHTS_FILE
    if not file.is_file():
        other = " (adapter_model.bin: only safetensors is read)" if (
            folder / "adapter_model.bin").exists() else ""
        raise ValueError(f"{where}: no {WEIGHTS_FILE}{other}")
    try:
        return load_file(file)
    except SafetensorError as e:
        raise ValueError(f"{where}: {WEIGHTS_FILE} is unreadable ({e})") from e


_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])"
                  r"(?:\.[A-Za-z0-9_-]+)?\.weight$")


def _pair_tensors(tensors: dict[str, torch.Tensor], where: str
                  ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Module name -> (A, B), from PEFT's ``base_model.model.<module>.lora_{A,B}.weight``."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise ValueError(f"{where}: tensor {key!r} is not the lora_A / lora_B weight of a "
                             "projection (LoRA applies to q/k/v/o/gate/up/down; LoRA on "
                             "lm_head or embeddings, DoRA magnitudes and saved modules are "
                             "not served)")
        found.setdefault(match["module"], {})[match["ab"]] = tensor
    pairs = {}
    for module, ab in found.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{where}: module {module!r} has lora_{'A' if 'B' in ab else 'B'} "
                             "missing")
        pairs[module] = (ab["A"], ab["B"])
    return pairs


def _check_shapes(where: str, module: str, a: torch.Tensor, b: torch.Tensor,
                  target: LoRATarget, shards: list[int], max_rank: int) -> None:
    rank = a.shape[0]
    out = sum(target.shard_sizes[i] for i in shards)
    if a.dim() != 2 or b.dim() != 2 or b.shape[1] != rank:
        raise ValueError(f"{where}: {module}: lora_A {tuple(a.shape)} and lora_B "
                         f"{tuple(b.shape)} do not share a rank")
    if rank > max_rank:
        raise ValueError(f"{where}: {module} has rank {rank}, above max_lora_rank {max_rank}")
    if a.shape[1] != target.in_features or b.shape[0] != out:
        raise ValueError(
            f"{where}: {module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit "
            f"its [{out}, {target.in_features}] weight (an adapter for another base model?)")


def _scale(config: dict, module: str, rank: int) -> float:
    """``alpha / r`` (``alpha / sqrt(r)`` with ``use_rslora``); ``alpha`` from
    ``alpha_pattern`` when a pattern matches the module, as PEFT's ``get_pattern_key``."""
    alpha = config["lora_alpha"]
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", f"model.{module}"):
            alpha = value
            break
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _fuse(target: LoRATarget, shards: dict[int, tuple[torch.Tensor, torch.Tensor, float]]
          ) -> ProjectionLoRA:
    """The kernel's layout of one projection from its shards' ``(A, B, scale)``."""
    rank = max(a.shape[0] for a, _, _ in shards.values())
    num = len(target.shard_sizes)
    a_all = torch.zeros(num * rank, target.in_features)
    bt = torch.zeros(rank, target.out_features)
    cols = target.shard_cols()
    for i, (a, b, scale) in shards.items():
        a_all[i * rank : i * rank + a.shape[0]] = a
        bt[: a.shape[0], cols[i] : cols[i + 1]] = (b * scale).t()
    return ProjectionLoRA(a_all, bt, rank)
