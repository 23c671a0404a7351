"""One rank's whole life on its device (vLLM's ``Worker``): build and load the model
(``model_loader.py``, with the quantization method), size the KV cache (a profiling pass
where the budget is a fraction of memory), allocate it, capture CUDA graphs, and run
``execute_model(scheduler_output)`` through its ``ModelRunner``. Workers never see the
scheduler's decisions as anything but a ``SchedulerOutput`` (rank 0) or tensors (ranks 1..).

Under tensor parallelism every rank holds a worker. Rank 0's lives in the engine's process
and its model is the executor's ``DriverModel`` (each call is first sent to the other
ranks); ranks 1.. run ``run_worker``: the same start-up in the same order, then the
driver's commands until told to stop::

    join the RankGroup -> load the shard -> agree on the block count (min over ranks)
    -> allocate the KV cache -> commands: forward, logits, copy, ..., shutdown

A command is what the driver's model does next: ``("forward", input_ids, positions, meta)``
runs the model on the same flat batch (its collectives pair with the driver's),
``("logits", hidden_rows)`` computes this rank's vocabulary shard of the logits for the
gather, ``("copy", pairs)`` copies KV blocks (copy-on-write).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable

import torch
from torch import nn

from pagedserve.args import EngineArgs
from pagedserve.attention import get_attention_backend
from pagedserve.config import CacheConfig, SchedulerConfig, SpeculativeConfig, resolve_device
from pagedserve.core.scheduler import SchedulerOutput
from pagedserve.distributed.group import RankGroup
from pagedserve.distributed.sharding import shard_config
from pagedserve.lora.config import LoRAConfig
from pagedserve.lora.manager import LoRAManager
from pagedserve.model_loader.model_config import ModelConfig
from pagedserve.worker.cpu_decode import CpuDecodeLayers
from pagedserve.worker.cuda_graphs import DecodeGraphs, capture_sizes
from pagedserve.worker.draft_runner import build_drafter
from pagedserve.worker.host_malloc import keep_freed_host_memory, release_freed_memory
from pagedserve.worker.kv_cache import (
    MemoryProfile,
    allocate_kv_caches,
    bytes_per_block,
    cpu_kv_budget,
    cuda_kv_budget,
    fixed_kv_budget,
    measure_cpu_peak,
    measure_cuda_peak,
    num_kv_blocks,
    resident_within_budget,
    total_memory_bytes,
)
from pagedserve.worker.model_loader import load_model
from pagedserve.worker.model_runner import ModelRunner, ModelRunnerOutput

logger = logging.getLogger(__name__)

# The profiled step's activations grow with both: tokens in a step, and rows of logits
# (one per sequence; 256 x SmolLM2's 49,152 vocabulary are 50 MB, sorted for sampling).
KV_MEMORY_HINT = ("give the KV cache more memory (--gpu-memory-utilization, "
                  "--kv-cache-memory-bytes or --memory-budget) or lower --max-num-seqs or "
                  "--max-num-batched-tokens")


def threads_per_rank(ranks_here: int) -> int:
    """OpenMP threads of one rank when ``ranks_here`` ranks share this machine's cores (the
    CPUs this process may run on): ``cores // ranks_here``, at least 1."""
    return max(1, len(os.sched_getaffinity(0)) // ranks_here)


def rank_device(device: str, rank: int) -> str:
    """This rank's device: ``cpu``, or CUDA device ``rank mod device_count``."""
    if device.startswith("cuda"):
        return f"cuda:{rank % torch.cuda.device_count()}"
    return device


@dataclasses.dataclass
class DriverHooks:
    """What rank 0's worker gets from the engine and its executor.

    Attributes:
        tokenizer: returns the tokenizer (a quantization method's calibration text).
        model_config: the engine's, resolved once (rank 0's device); None on ranks 1..,
            which resolve their own device.
        eos_token_id: the sampler's EOS (``min_tokens`` masks it).
        grammar_bitmask: the structured-output bitmask of the rows to sample.
        wrap_model: the executor's wrapper of rank 0's model (``DriverModel``), if any.
        runner_class: the model runner's class (the executor's, for block copies on
            every rank).
    """

    tokenizer: Callable[[], object]
    model_config: ModelConfig | None = None
    eos_token_id: int | None = None
    grammar_bitmask: Callable | None = None
    wrap_model: Callable[[nn.Module], nn.Module] | None = None
    runner_class: type[ModelRunner] = ModelRunner


class Worker:
    """One rank's model, KV cache and model runner (see the module docstring).

    Raises ``ValueError`` (bad arguments, unsupported model) or ``FileNotFoundError``
    (missing model) while loading.
    """

    def __init__(self, args: EngineArgs, hooks: DriverHooks, rank: int = 0,
                 group: RankGroup | None = None) -> None:
        self.args, self.group = args, group
        self.model_config = config = hooks.model_config or ModelConfig.from_args(
            args, rank_device(resolve_device(args.device), rank))
        torch.manual_seed(args.seed)
        self.kv_config = shard_config(config.hf_config, 1 if group is None else group.world_size)
        self.attention_backend = get_attention_backend(args.attention_backend, config.device)
        model = load_model(args, config.hf_config, config.model_path, config.device,
                           config.dtype, self.attention_backend, config.max_model_len, group,
                           hooks.tokenizer)
        if torch.device(config.device).type == "cpu":
            keep_freed_host_memory()  # activations reused step after step, not faulted in
        lora = LoRAConfig.from_engine_args(args)
        self.lora = None if lora is None else LoRAManager(model, lora)  # one rank (engine)
        if self.lora is not None and model.cpu_decode is not None:
            model.cpu_decode = CpuDecodeLayers.build(model)  # again, with the LoRA stacks
        self.model = model if hooks.wrap_model is None else hooks.wrap_model(model)
        self.model_runner = hooks.runner_class(
            self.model, args.block_size, config.device, config.hf_config.vocab_size,
            hooks.eos_token_id, hooks.grammar_bitmask)
        self.model_runner.lora = self.lora
        # Speculative decoding: rank 0 drafts (the engine allows model drafts on one rank).
        self.draft_kv_config = None  # a draft model's own KV cache, in the same blocks
        spec = SpeculativeConfig.from_dict(args.speculative_config)
        if spec is not None and (group is None or group.rank == 0):
            self.model_runner.drafter, self.draft_kv_config = build_drafter(
                spec, args, config, self.attention_backend, hooks.eos_token_id,
                hooks.tokenizer)
        self.memory_profile: MemoryProfile | None = None  # set by determine_num_blocks

    def determine_num_blocks(self, cache: CacheConfig, sched: SchedulerConfig) -> int:
        """How many KV blocks this rank can hold (``num_kv_blocks``); raises ``ValueError``
        when not even one ``max_model_len`` sequence fits."""
        self.memory_profile = self._profile_memory(cache, sched)
        return num_kv_blocks(cache, self.memory_profile.bytes_per_block,
                             self.memory_profile.kv_budget, self.model_config.max_model_len,
                             KV_MEMORY_HINT)

    def initialize_cache(self, num_blocks: int, max_num_seqs: int) -> None:
        """Allocate ``num_blocks`` KV blocks per layer; capture decode graphs over them."""
        config = self.model_config
        self.model_runner.kv_caches = allocate_kv_caches(
            self.kv_config, num_blocks, self.args.block_size, config.kv_cache_dtype,
            config.device)
        if self.draft_kv_config is not None:
            self.model_runner.drafter.kv_caches = self.model_runner.draft_kv_caches = (
                allocate_kv_caches(self.draft_kv_config, num_blocks, self.args.block_size,
                                   config.kv_cache_dtype, config.device))
        self.model_runner.decode_graphs = self._capture_decode_graphs(max_num_seqs)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(sched)

    def _profile_memory(self, cache: CacheConfig, sched: SchedulerConfig) -> MemoryProfile:
        """Size the KV budget: weights + the activation peak of the largest step (measured
        by a profiling forward pass) are subtracted from what the engine may use; the CPU
        default and tensor parallelism use a fixed size that needs no profiling (see
        ``kv_cache.py``)."""
        config = self.model_config
        per_block = sum(bytes_per_block(c, cache.block_size, config.kv_cache_dtype)
                        for c in (self.kv_config, self.draft_kv_config) if c is not None)
        drafter = self.model_runner.drafter
        models = [self.model, *([] if drafter is None or drafter.model is None else [drafter.model])]
        weights = sum(p.numel() * p.element_size() for m in models for p in m.parameters())
        weights += 0 if self.lora is None else self.lora.num_bytes
        ranks = 1 if self.group is None else self.group.world_size
        fixed = fixed_kv_budget(cache, per_block, config.device, ranks)
        if fixed is not None:
            total = total_memory_bytes() if fixed[1] == "cpu_default" else 0
            return MemoryProfile(total, weights, 0, fixed[0], per_block, fixed[1])
        if cache.memory_budget is not None:
            if not config.device.startswith("cpu") or ranks > 1:
                raise ValueError("memory_budget sizes one CPU process; use "
                                 "gpu_memory_utilization on a device or with several ranks")
            held = resident_within_budget(cache.memory_budget, weights)
        tokens = sched.max_num_batched_tokens
        num_blocks = -(-tokens // cache.block_size) + -(-tokens // config.max_model_len)
        scratch = allocate_kv_caches(config.hf_config, num_blocks, cache.block_size,
                                     config.kv_cache_dtype, config.device)

        def run() -> None:
            self.model_runner.profile_run(tokens, sched.max_num_seqs, config.max_model_len,
                                          scratch)

        if config.device.startswith("cuda"):
            peak = measure_cuda_peak(run, config.device)
            scratch.clear()  # free the scratch blocks before reading what the device has left
            total, budget, source = cuda_kv_budget(cache, peak, config.device)
        else:
            for blocks in scratch:  # resident before the measure: KV blocks, not activations
                blocks.zero_()
            peak = measure_cpu_peak(run)
            scratch.clear()
            release_freed_memory()  # the profiled step's freed activations, not kept resident
            if cache.memory_budget is not None:  # the process: what it holds, its peak, KV
                total, budget = cache.memory_budget, cache.memory_budget - held - peak
                source = "memory_budget"
                logger.info("memory budget %d bytes: %d held after loading or kept for serving, "
                            "activation peak %d, KV cache %d", total, held, peak, budget)
            else:
                total, budget = cpu_kv_budget(cache, weights, peak)
                source = "gpu_memory_utilization"
        return MemoryProfile(total, weights, peak, budget, per_block, source)

    def _capture_decode_graphs(self, max_num_seqs: int) -> DecodeGraphs | None:
        """CUDA graphs of pure-decode steps for ``capture_sizes(max_num_seqs)``, captured
        over the allocated KV cache; None with ``enforce_eager``, on CPU, under tensor
        parallelism, with LoRA (its token slots change every step), or with an attention
        backend other than triton (the others size their work per step)."""
        config = self.model_config
        if (self.args.enforce_eager or not config.device.startswith("cuda")
                or self.group is not None or self.lora is not None):
            return None
        if self.attention_backend.name != "triton":
            logger.info("no CUDA graphs with the %s attention backend: decode runs eagerly",
                        self.attention_backend.name)
            return None
        t0 = time.perf_counter()
        graphs = DecodeGraphs(self.model, self.model_runner.kv_caches,
                              capture_sizes(max_num_seqs), config.max_model_len,
                              self.args.block_size, config.device)
        graphs.capture()
        logger.info("captured CUDA graphs of decode steps for %d batch sizes (1..%d) in %.1f s",
                    len(graphs.sizes), graphs.max_batch_size, time.perf_counter() - t0)
        return graphs

    # -- ranks 1.. -----------------------------------------------------------------------

    @torch.inference_mode()
    def serve(self) -> None:
        """Run the driver's commands until ``shutdown``; raises ``RuntimeError`` for an
        unknown one."""
        model = self.model
        while True:
            command, *payload = self.group.recv_command()
            if command == "shutdown":
                logger.info("shutting down")
                return
            if command == "forward":
                input_ids, positions, meta = (self._to_device(x) for x in payload)
                model(input_ids, positions, self.model_runner.kv_caches, meta)
            elif command == "logits":
                model.compute_logits(self._to_device(payload[0]))
            elif command == "copy":
                self.model_runner.copy_blocks(payload[0])
            else:
                raise RuntimeError(f"unknown command {command!r} from the driver")

    def _to_device(self, x):
        """A tensor, or a dataclass of tensors (``AttentionMetadata``), on this rank's device."""
        device = self.model_config.device
        if isinstance(x, torch.Tensor):
            return x.to(device)
        changes = {f.name: getattr(x, f.name).to(device) for f in dataclasses.fields(x)
                   if isinstance(getattr(x, f.name), torch.Tensor)}
        return dataclasses.replace(x, **changes)


def run_worker(rank: int, world_size: int, host: str, port: int, args: EngineArgs,
               ranks_here: int) -> None:
    """Entry point of rank ``rank`` (>= 1) in an ``mp`` process or a Ray actor: returns
    after the driver's shutdown command; raises (and the process exits non-zero) if the
    driver goes away or a step fails."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {rank} %(levelname)s "
                        "%(name)s: %(message)s")
    torch.set_num_threads(threads_per_rank(ranks_here))
    device = rank_device(resolve_device(args.device), rank)
    group = RankGroup(rank, world_size, host, port, args.distributed_timeout, device)
    logger.info("joined %d ranks (%d torch threads, %s)", world_size, torch.get_num_threads(),
                device)
    worker = Worker(args, DriverHooks(tokenizer=lambda: None), rank, group)
    cache = CacheConfig.from_engine_args(args)
    num_blocks = group.all_reduce_min(worker.determine_num_blocks(cache, SchedulerConfig()))
    worker.initialize_cache(num_blocks, args.max_num_seqs)
    worker.serve()
