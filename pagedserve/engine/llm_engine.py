"""The synchronous engine: ``step()`` = schedule -> execute_model -> update_from_output.

The engine holds the scheduler, the output processor and an executor; the executor holds
the workers, which hold the model and its KV cache (``worker/worker.py``).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import asdict, replace

from pagedserve.args import EngineArgs
from pagedserve.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from pagedserve.core.kv_cache_manager import KVCacheManager, KVCacheStats
from pagedserve.core.scheduler import Scheduler
from pagedserve.distributed.config import ParallelConfig
from pagedserve.distributed.sharding import check_tensor_parallel
from pagedserve.engine.input_processor import InputProcessor, PromptType
from pagedserve.engine.output_processor import OutputProcessor, ParentState
from pagedserve.engine.timeline import StepTimeline
from pagedserve.executor import create_executor
from pagedserve.lora.config import LoRAConfig
from pagedserve.lora.registry import LoRARegistry
from pagedserve.lora.request import LoRARequest
from pagedserve.metrics import SpecDecodingStats
from pagedserve.model_loader.files import resolve_model_path
from pagedserve.model_loader.model_config import ModelConfig
from pagedserve.models.registry import get_model_class
from pagedserve.outputs import RequestMetrics, RequestOutput
from pagedserve.request import Request, RequestStatus
from pagedserve.sampling_params import SamplingParams
from pagedserve.structured_output import StructuredOutputManager
from pagedserve.tokenizer import load_tokenizer
from pagedserve.worker.worker import DriverHooks

logger = logging.getLogger(__name__)

__all__ = ["LLMEngine", "PromptType"]


class LLMEngine:
    """Loads a model (through its executor's workers) and serves requests one engine step
    at a time.

    Raises ``ValueError`` (bad arguments, unsupported model) or ``FileNotFoundError``
    (missing model path) at construction.
    """

    def __init__(self, args: EngineArgs) -> None:
        self.spec_config = spec = SpeculativeConfig.from_dict(args.speculative_config)
        if spec is not None:
            args = replace(args, quantization=spec.target_quantization(
                args.quantization, args.tensor_parallel_size))
        self.spec_stats = None if spec is None else SpecDecodingStats(spec.num_speculative_tokens)
        self.lora_config = LoRAConfig.from_engine_args(args, spec)
        self.args = args
        self.model_config = config = ModelConfig.from_args(args)
        self.model_path, self.hf_config = config.model_path, config.hf_config
        self.device, self.dtype = config.device, config.dtype
        self.max_model_len = config.max_model_len
        self.tokenizer = None
        if not args.skip_tokenizer_init:
            self.tokenizer = self._load_tokenizer()
        default_batched = 2048 if args.enable_chunked_prefill else max(2048, self.max_model_len)
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=(default_batched if args.max_num_batched_tokens is None
                                    else args.max_num_batched_tokens),
            max_model_len=self.max_model_len,
            enable_chunked_prefill=args.enable_chunked_prefill,
            scheduling=args.scheduling,
        )
        self.cache_config = CacheConfig.from_engine_args(args)
        self.parallel_config = ParallelConfig.from_engine_args(args)
        self.parallel_config.check_engine(self.cache_config, self.device)
        # before any rank starts: a model we cannot build or its ranks cannot split fails at once
        get_model_class(self.hf_config)
        check_tensor_parallel(self.hf_config, self.parallel_config.tensor_parallel_size)
        self.input_processor = InputProcessor(self.tokenizer, config, args.max_logprobs,
                                              args.max_num_seqs)
        self.eos_token_id = self.input_processor.eos_token_id
        self.structured_output = StructuredOutputManager(
            self.tokenizer, self.hf_config.vocab_size,
            [t for t in (self.eos_token_id, *self.input_processor.extra_eos_token_ids)
             if t is not None],
            args.structured_outputs_backend)
        # Ranks 1.. start first and load their shards while this process loads rank 0's.
        self.executor = create_executor(self.parallel_config, args, DriverHooks(
            self._calibration_tokenizer, config, self.eos_token_id,
            self.structured_output.grammar_bitmask))
        try:
            self.num_blocks = self.executor.initialize_cache(self.cache_config,
                                                             self.scheduler_config)
        except BaseException:
            self.executor.shutdown()
            raise
        self._finalizer = weakref.finalize(self, self.executor.shutdown)
        self.kv_cache_manager = KVCacheManager(self.num_blocks, args.block_size,
                                               args.enable_prefix_caching)
        self.scheduler = Scheduler(self.scheduler_config, self.kv_cache_manager, spec,
                                   self.lora_config and self.lora_config.max_loras)
        self.loras = LoRARegistry(self.executor.driver_worker.lora, lambda lora_id: sum(
            r.lora_id == lora_id for r in self.scheduler.requests.values()))
        self.output_processor = OutputProcessor(self.tokenizer)
        # The last steps, for the dashboard; a benchmark may swap in an unbounded one.
        self.timeline = StepTimeline()
        self._log_start()

    def _load_tokenizer(self):
        args = self.args
        return load_tokenizer(resolve_model_path(args.tokenizer) if args.tokenizer
                              else self.model_path)

    def _calibration_tokenizer(self):
        """The tokenizer for a quantization method's calibration text (loaded here with
        ``skip_tokenizer_init``)."""
        return self.tokenizer if self.tokenizer is not None else self._load_tokenizer()

    def _log_start(self) -> None:
        profile = self.executor.driver_worker.memory_profile
        pool_tokens = self.num_blocks * self.args.block_size
        logger.info(
            "model %s on %s (%s); KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB, %s); "
            "max concurrency at max_model_len %d: %.2fx",
            self.model_path, self.device, str(self.dtype).removeprefix("torch."), self.num_blocks,
            self.args.block_size, pool_tokens, self.num_blocks * profile.bytes_per_block / 2**20,
            profile.source, self.max_model_len, pool_tokens / self.max_model_len,
        )

    # -- requests -----------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    arrival_time: float | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Queue a request (with ``lora_request``'s adapter, registered if new). Raises
        ``ValueError`` for a bad prompt, parameters or adapter; nothing is queued then."""
        if request_id in self.output_processor.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids, params = self.input_processor.process(prompt, params)
        grammars = self.structured_output.request_grammars(params, params.n)
        lora_id = 0 if lora_request is None else self.loras.add(lora_request)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        children = []
        for i in range(params.n):
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = replace(params, seed=params.seed + i)  # distinct, reproducible
            child_id = request_id if params.n == 1 else f"{i}_{request_id}"
            children.append(Request(child_id, token_ids, child_params, self.eos_token_id,
                                    arrival, grammars[i], lora_id,
                                    lora_request and lora_request.lora_name))
        parent = ParentState(request_id, text, token_ids, params, RequestMetrics(arrival))
        self.output_processor.add_request(parent, children)
        self.scheduler.add_request(children[0], forks=children[1:])

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests by id; their blocks are freed at once. Unknown ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            parent = self.output_processor.parents.get(rid)
            if parent is None:
                continue
            self.scheduler.finish_requests([s.request.request_id for s in parent.samples],
                                           RequestStatus.FINISHED_ABORTED)
            self.output_processor.remove(parent)

    # -- LoRA adapters: vLLM's names; the rest is ``self.loras`` (lora/registry.py) -------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register an adapter (True; ``ValueError`` for a bad one, see ``LoRARegistry.add``)."""
        return self.loras.add(lora_request) > 0

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unregister an adapter (``LoRARegistry.remove``: ``LoRAInUseError`` if in use)."""
        return self.loras.remove(lora_int_id)

    def list_loras(self) -> set[int]:
        return set(self.loras.by_int_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.parents)

    # -- one step -----------------------------------------------------------------------

    def step(self, on_scheduled: Callable[[], None] | None = None) -> list[RequestOutput]:
        """Run one engine step; returns the outputs of requests that made progress.

        ``on_scheduled`` (if given) is called once the step is scheduled and before the
        model runs, so that observers (the server's metrics) see the requests of a long
        step as running while it computes; it is not called for an empty step. Every
        non-empty step is recorded in ``self.timeline`` (the dashboard's step chart).
        """
        self.executor.check_alive()
        start = time.monotonic()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        started = self.timeline.begin(sched, start)
        self.output_processor.mark_scheduled(sched.requests)
        if on_scheduled is not None:
            on_scheduled()
        try:
            out = self.executor.execute_model(sched)
        except Exception:
            # Blocks published to the prefix cache in this step were never filled.
            self.kv_cache_manager.pool.reset_prefix_cache()
            raise
        if self.spec_stats is not None:
            for rid, drafts in sched.spec_token_ids.items():  # before stops cut the tokens
                self.spec_stats.observe(len(drafts), len(out.sampled[rid]) - 1)
        self.scheduler.update_from_output(sched, out.sampled, out.spec_token_ids)
        forked = [child for children in sched.forks.values() for child in children]
        self.structured_output.advance(sched.requests + forked, out.sampled)
        touched, stopped = self.output_processor.process(sched.requests + forked, out)
        self.scheduler.finish_requests([r.request_id for r in stopped],
                                       RequestStatus.FINISHED_STOPPED)
        self.timeline.end(started, self.scheduler)
        return [self.output_processor.make_output(parent) for parent in touched]

    def is_healthy(self) -> bool:
        """False once a rank has died or hung (``EngineDeadError``); thread-safe."""
        return self.executor.is_alive()

    def shutdown(self) -> None:
        """Stop the other ranks (idempotent). The engine takes no steps afterwards."""
        self._finalizer()

    def cache_config_info(self) -> dict[str, str]:
        """The KV cache configuration as strings, for vLLM's ``vllm:cache_config_info``
        labels (vLLM's ``CacheConfig.metrics_info``: ``str()`` of each value, so ``None``,
        ``True``): the ``CacheConfig`` fields, ``num_gpu_blocks`` (the pool's real size) and
        ``cache_dtype`` (``--kv-cache-dtype``; ``auto``: the model's dtype, vLLM's default)."""
        info = {k: str(v) for k, v in asdict(self.cache_config).items()}
        info.update(num_gpu_blocks=str(self.num_blocks), cache_dtype=self.args.kv_cache_dtype)
        return info

    def spec_decoding_stats(self) -> SpecDecodingStats | None:
        """Speculative decoding's cumulative counts (a copy), or None without it."""
        return None if self.spec_stats is None else self.spec_stats.copy()

    def kv_cache_stats(self) -> KVCacheStats:
        num_tokens = sum(r.num_computed_tokens for r in self.scheduler.running)
        return self.kv_cache_manager.stats(num_tokens)

