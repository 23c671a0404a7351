"""A non-driver tensor-parallel rank: it builds its shard and KV cache, then runs the
driver's commands until told to stop. The same code runs in an ``mp`` process and in a Ray
actor.

Start-up, in the same order on every rank (the driver's side is in ``LLMEngine``)::

    join the RankGroup -> load the shard -> agree on the block count (min over ranks)
    -> allocate the KV cache -> commands: forward, logits, copy, ..., shutdown

A command is what the driver's ``DriverModel`` does next: ``("forward", input_ids,
positions, meta)`` runs the model on the same flat batch (its collectives pair with the
driver's), ``("logits", hidden_rows)`` computes this rank's vocabulary shard of the logits
for the gather, ``("copy", pairs)`` copies KV blocks (copy-on-write). Workers never see
requests: only tensors.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from pagedserve.attention import get_attention_backend
from pagedserve.config import CacheConfig, resolve_device, resolve_dtype, resolve_kv_cache_dtype
from pagedserve.distributed.group import RankGroup
from pagedserve.distributed.sharding import shard_config
from pagedserve.args import EngineArgs
from pagedserve.model_loader.files import load_config, resolve_model_path
from pagedserve.worker.kv_cache import (
    allocate_kv_caches,
    bytes_per_block,
    fixed_kv_budget,
    num_kv_blocks,
)
from pagedserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def threads_per_rank(ranks_here: int) -> int:
    """OpenMP threads of one rank when ``ranks_here`` ranks share this machine's cores (the
    CPUs this process may run on): ``cores // ranks_here``, at least 1."""
    return max(1, len(os.sched_getaffinity(0)) // ranks_here)


def rank_device(device: str, rank: int) -> str:
    """This rank's device: ``cpu``, or CUDA device ``rank mod device_count``."""
    if device.startswith("cuda"):
        return f"cuda:{rank % torch.cuda.device_count()}"
    return device


def run_worker(rank: int, world_size: int, host: str, port: int, args: EngineArgs,
               ranks_here: int) -> None:
    """Entry point of rank ``rank`` (>= 1): returns after the driver's shutdown command;
    raises (and the process exits non-zero) if the driver goes away or a step fails."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {rank} %(levelname)s "
                        "%(name)s: %(message)s")
    torch.set_num_threads(threads_per_rank(ranks_here))
    device = rank_device(resolve_device(args.device), rank)
    group = RankGroup(rank, world_size, host, port, args.distributed_timeout, device)
    logger.info("joined %d ranks (%d torch threads, %s)", world_size, torch.get_num_threads(),
                device)
    Worker(args, group, device).serve()


class Worker:
    """One rank's model shard, KV cache and command loop (see the module docstring)."""

    def __init__(self, args: EngineArgs, group: RankGroup, device: str) -> None:
        # imported here: llm_engine imports the executors, which import this module
        from pagedserve.engine.llm_engine import KV_MEMORY_HINT, load_model

        self.group, self.device = group, device
        dtype = resolve_dtype(args.dtype, device)
        torch.manual_seed(args.seed)
        model_path = resolve_model_path(args.model)
        hf_config = load_config(model_path)
        max_model_len = args.max_model_len or hf_config.max_position_embeddings
        backend = get_attention_backend(args.attention_backend, device)
        model = load_model(args, hf_config, model_path, device, dtype, backend, max_model_len,
                           group)
        self.runner = ModelRunner(model, args.block_size, device, hf_config.vocab_size, None)
        kv_config = shard_config(hf_config, group.world_size)
        cache = CacheConfig(block_size=args.block_size,
                            num_gpu_blocks_override=args.num_gpu_blocks_override,
                            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                            gpu_memory_utilization=args.gpu_memory_utilization)
        kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype)
        per_block = bytes_per_block(kv_config, args.block_size, kv_dtype)
        budget, _ = fixed_kv_budget(cache, per_block, device, group.world_size)
        num_blocks = group.all_reduce_min(
            num_kv_blocks(cache, per_block, budget, max_model_len, KV_MEMORY_HINT))
        self.runner.kv_caches = allocate_kv_caches(kv_config, num_blocks, args.block_size,
                                                   kv_dtype, device)

    @torch.inference_mode()
    def serve(self) -> None:
        """Run commands until ``shutdown``; raises ``RuntimeError`` for an unknown one."""
        model = self.runner.model
        while True:
            command, *payload = self.group.recv_command()
            if command == "shutdown":
                logger.info("shutting down")
                return
            if command == "forward":
                input_ids, positions, meta = (self._to_device(x) for x in payload)
                model(input_ids, positions, self.runner.kv_caches, meta)
            elif command == "logits":
                model.compute_logits(self._to_device(payload[0]))
            elif command == "copy":
                self.runner.copy_blocks(payload[0])
            else:
                raise RuntimeError(f"unknown command {command!r} from the driver")

    def _to_device(self, x):
        """A tensor, or a dataclass of tensors (``AttentionMetadata``), on this rank's device."""
        if isinstance(x, torch.Tensor):
            return x.to(self.device)
        changes = {f.name: getattr(x, f.name).to(self.device) for f in dataclasses.fields(x)
                   if isinstance(getattr(x, f.name), torch.Tensor)}
        return dataclasses.replace(x, **changes)
