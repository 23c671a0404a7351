"""The synchronous engine: ``step()`` = schedule -> execute_model -> update_from_output."""

from __future__ import annotations

import json
import logging
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import asdict, replace

import torch

from pagedserve.attention import get_attention_backend
from pagedserve.config import (
    CacheConfig,
    SchedulerConfig,
    resolve_device,
    resolve_dtype,
    resolve_kv_cache_dtype,
)
from pagedserve.core.kv_cache_manager import KVCacheManager, KVCacheStats
from pagedserve.core.scheduler import Scheduler
from pagedserve.distributed.config import ParallelConfig
from pagedserve.executor.multiproc import create_executor
from pagedserve.distributed.group import RankGroup
from pagedserve.distributed.sharding import make_tensor_parallel, shard_config, shard_weights
from pagedserve.args import EngineArgs
from pagedserve.engine.output_processor import OutputProcessor, ParentState
from pagedserve.engine.timeline import StepTimeline
from pagedserve.worker.cpu_decode import CpuDecodeLayers
from pagedserve.model_loader.gguf_file import iter_gguf_blocks
from pagedserve.quantization.int8 import FLOAT_LAYERS, quantize_model
from pagedserve.model_loader.files import iter_weights, load_config, resolve_model_path
from pagedserve.quantization.linear import (
    KERNEL_TYPES,
    MAX_ROWS,
    PACKED_MIN_ROWS,
    attach_gguf_weights,
    pack_model_weights,
    packing_available,
    use_gguf_kernels,
)
from pagedserve.models.registry import get_model_class
from pagedserve.quantization.smoothquant import calibration_token_ids, smooth_model, smoothable
from pagedserve.outputs import RequestMetrics, RequestOutput
from pagedserve.request import Request, RequestStatus
from pagedserve.sample.sampler import make_generator
from pagedserve.sampling_params import SamplingParams
from pagedserve.structured_output import StructuredOutputManager
from pagedserve.tokenizer import encode_text
from pagedserve.worker.cuda_graphs import DecodeGraphs, capture_sizes
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
    total_memory_bytes,
)

logger = logging.getLogger(__name__)

KV_MEMORY_HINT = ("give the KV cache more memory (--gpu-memory-utilization or "
                  "--kv-cache-memory-bytes) or lower --max-num-batched-tokens")

# A prompt: text, token ids, or vLLM's {"prompt_token_ids": [...]} (optionally with its text
# under "prompt") / {"prompt": "..."}.
PromptType = str | list[int] | dict


def load_model(args: EngineArgs, hf_config, model_path, device: str, dtype: torch.dtype,
               backend, max_model_len: int, group: RankGroup | None = None,
               tokenizer=None) -> torch.nn.Module:
    """Build the model and load its weights (``args.load_format``, ``args.quantization``).

    With ``group`` (tensor parallel), this rank's shard: built from ``shard_config``, read
    through ``shard_weights``, wrapped by ``make_tensor_parallel``; GGUF weights are then
    dequantized only (the GGUF block kernels read whole rows). ``tokenizer`` (loaded here
    if None and needed) turns int8's calibration text into tokens.
    Raises ``ValueError`` for a bad ``load_format``.
    """
    tp = 1 if group is None else group.world_size
    cls = get_model_class(hf_config)
    gguf_kernels = tp == 1 and use_gguf_kernels(args.quantization, model_path, device)
    with torch.device(device):
        model = cls(shard_config(hf_config, tp), backend, max_model_len).to(dtype)
        if group is not None:
            model = make_tensor_parallel(model, group, hf_config.vocab_size)
    if args.load_format == "dummy":  # vLLM's name: random weights, for benchmarks
        for param in model.parameters():
            param.data.uniform_(-1e-3, 1e-3)
    elif args.load_format == "auto":
        weights = iter_weights(model_path, dtype)
        if group is not None:
            weights = shard_weights(weights, hf_config, group.rank, tp)
        model.load_weights(weights)
        if gguf_kernels:
            count = attach_gguf_weights(model, iter_gguf_blocks(model_path, KERNEL_TYPES))
            logger.info("%d weights also kept as GGUF blocks for steps of <= %d tokens",
                        count, MAX_ROWS)
    else:
        raise ValueError(f"load_format must be auto or dummy; got {args.load_format!r}")
    inner = model if group is None else model.model
    if args.quantization == "int8":
        quantize_int8(inner, hf_config, model_path, tokenizer, group, max_model_len)
    if packing_available(device, dtype):
        logger.info("%d weights packed for MKL (steps of >= %d tokens)",
                    pack_model_weights(inner), PACKED_MIN_ROWS)
    if group is None:  # its layers, not the tensor-parallel ones with their all-reduces
        model.cpu_decode = CpuDecodeLayers.build(model)
    return model.eval()


def quantize_int8(model: torch.nn.Module, hf_config, model_path, tokenizer,
                  group: RankGroup | None, max_model_len: int) -> None:
    """``--quantization int8``: SmoothQuant (``models/smoothquant.py``, calibration chats
    cut to ``max_model_len`` tokens) and then every Linear in int8 where every layer could
    be smoothed; else (other layer kinds, or tensor parallel, whose ranks cannot run a
    calibration prefill alone) ``FLOAT_LAYERS`` stay float and nothing is smoothed."""
    smoothed = 0
    if group is None and smoothable(model):
        if tokenizer is None:
            from pagedserve.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(model_path)
        calibration = [ids[:max_model_len] for ids in calibration_token_ids(tokenizer)]
        smoothed = smooth_model(model, hf_config, calibration)
    skip = () if smoothed else FLOAT_LAYERS
    logger.info("%d weights quantized to int8 (W8A8; %s)", quantize_model(model, skip=skip),
                "SmoothQuant on every layer" if smoothed else
                f"no SmoothQuant, {', '.join(FLOAT_LAYERS)} left in float")


class LLMEngine:
    """Loads a model and serves requests one engine step at a time.

    Raises ``ValueError`` (bad arguments, unsupported model) or ``FileNotFoundError``
    (missing model path) at construction.
    """

    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.device = resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, self.device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, self.dtype)
        torch.manual_seed(args.seed)
        self.model_path = resolve_model_path(args.model)
        self.hf_config = load_config(self.model_path)
        self.tokenizer = None
        if not args.skip_tokenizer_init:
            from pagedserve.tokenizer import load_tokenizer

            self.tokenizer = load_tokenizer(resolve_model_path(args.tokenizer) if args.tokenizer
                                            else self.model_path)
        self.eos_token_id = self._eos_token_id()
        self.extra_eos_token_ids = self._extra_eos_token_ids()
        self.max_model_len = (self.hf_config.max_position_embeddings if args.max_model_len is None
                              else args.max_model_len)
        default_batched = 2048 if args.enable_chunked_prefill else max(2048, self.max_model_len)
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=(default_batched if args.max_num_batched_tokens is None
                                    else args.max_num_batched_tokens),
            max_model_len=self.max_model_len,
            enable_chunked_prefill=args.enable_chunked_prefill,
            scheduling=args.scheduling,
        )
        self.cache_config = CacheConfig(
            block_size=args.block_size,
            num_gpu_blocks_override=args.num_gpu_blocks_override,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            gpu_memory_utilization=args.gpu_memory_utilization,
            enable_prefix_caching=args.enable_prefix_caching,
        )
        self.parallel_config = ParallelConfig.from_engine_args(args)
        self._check_parallel()
        tp = self.parallel_config.tensor_parallel_size
        self.kv_config = shard_config(self.hf_config, tp)  # one rank's KV heads
        self.attention_backend = get_attention_backend(args.attention_backend, self.device)
        self.structured_output = StructuredOutputManager(
            self.tokenizer, self.hf_config.vocab_size,
            [t for t in (self.eos_token_id, *self.extra_eos_token_ids) if t is not None],
            args.structured_outputs_backend)
        # Ranks 1.. start first and load their shards while this process loads rank 0's.
        self.executor = create_executor(self.parallel_config, args)
        try:
            self.model = self.executor.driver_model(load_model(
                args, self.hf_config, self.model_path, self.device, self.dtype,
                self.attention_backend, self.max_model_len, self.executor.group,
                self.tokenizer))
            self.model_runner = self.executor.model_runner_class(
                self.model, args.block_size, self.device, self.hf_config.vocab_size,
                self.eos_token_id, self.structured_output.grammar_bitmask)
            self.memory_profile = self._profile_memory()
            self.num_blocks = self.executor.agree_num_blocks(num_kv_blocks(
                self.cache_config, self.memory_profile.bytes_per_block,
                self.memory_profile.kv_budget, self.max_model_len, KV_MEMORY_HINT))
        except BaseException:
            self.executor.shutdown()
            raise
        self._finalizer = weakref.finalize(self, self.executor.shutdown)
        self.model_runner.kv_caches = allocate_kv_caches(
            self.kv_config, self.num_blocks, args.block_size, self.kv_cache_dtype, self.device)
        self.model_runner.decode_graphs = self._capture_decode_graphs()
        self.kv_cache_manager = KVCacheManager(self.num_blocks, args.block_size,
                                               args.enable_prefix_caching)
        self.scheduler = Scheduler(self.scheduler_config, self.kv_cache_manager)
        self.output_processor = OutputProcessor(self.tokenizer)
        # The last steps, for the dashboard; a benchmark may swap in an unbounded one.
        self.timeline = StepTimeline()
        pool_tokens = self.num_blocks * args.block_size
        logger.info(
            "model %s on %s (%s); KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB, %s); "
            "max concurrency at max_model_len %d: %.2fx",
            self.model_path, self.device, str(self.dtype).removeprefix("torch."), self.num_blocks,
            args.block_size, pool_tokens,
            self.num_blocks * self.memory_profile.bytes_per_block / 2**20,
            self.memory_profile.source, self.max_model_len, pool_tokens / self.max_model_len,
        )

    def _profile_memory(self) -> MemoryProfile:
        """Size the KV budget: weights + the activation peak of the largest step (measured
        by a profiling forward pass) are subtracted from what the engine may use; the CPU
        default is a fixed size that needs no profiling (see ``worker/kv_cache.py``)."""
        cache, sched = self.cache_config, self.scheduler_config
        per_block = bytes_per_block(self.kv_config, cache.block_size, self.kv_cache_dtype)
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        fixed = fixed_kv_budget(cache, per_block, self.device,
                                self.parallel_config.tensor_parallel_size)
        if fixed is not None:
            total = total_memory_bytes() if fixed[1] == "cpu_default" else 0
            return MemoryProfile(total, weights, 0, fixed[0], per_block, fixed[1])
        tokens = sched.max_num_batched_tokens
        num_blocks = -(-tokens // cache.block_size) + -(-tokens // self.max_model_len)
        scratch = allocate_kv_caches(self.hf_config, num_blocks, cache.block_size,
                                     self.kv_cache_dtype, self.device)

        def run() -> None:
            self.model_runner.profile_run(tokens, sched.max_num_seqs, self.max_model_len, scratch)

        if self.device.startswith("cuda"):
            peak = measure_cuda_peak(run, self.device)
            scratch.clear()  # free the scratch blocks before reading what the device has left
            total, budget, source = cuda_kv_budget(cache, peak, self.device)
        else:
            peak = measure_cpu_peak(run)
            total, budget = cpu_kv_budget(cache, weights, peak)
            source = "gpu_memory_utilization"
        return MemoryProfile(total, weights, peak, budget, per_block, source)

    def _check_parallel(self) -> None:
        """Refuse what the tensor-parallel path does not do (``ValueError``, naming the flag)."""
        parallel = self.parallel_config
        if parallel.data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 runs replicas of this engine behind "
                             "`pagedserve serve`; one LLMEngine is one replica")
        if parallel.tensor_parallel_size == 1:
            return
        if self.cache_config.gpu_memory_utilization is not None or self.device != "cpu":
            needs_profile = (self.cache_config.num_gpu_blocks_override is None
                             and self.cache_config.kv_cache_memory_bytes is None)
            if needs_profile:
                raise ValueError("tensor_parallel_size > 1 sizes the KV cache without a "
                                 "profiling pass: give --kv-cache-memory-bytes (per rank) or "
                                 "--num-gpu-blocks-override instead of "
                                 "--gpu-memory-utilization")

    def _capture_decode_graphs(self) -> DecodeGraphs | None:
        """CUDA graphs of pure-decode steps for ``capture_sizes(max_num_seqs)``, captured
        over the allocated KV cache; None with ``enforce_eager``, on CPU, or with an
        attention backend other than triton (the others size their work per step)."""
        if (self.args.enforce_eager or not self.device.startswith("cuda")
                or self.parallel_config.tensor_parallel_size > 1):
            return None
        if self.attention_backend.name != "triton":
            logger.info("no CUDA graphs with the %s attention backend: decode runs eagerly",
                        self.attention_backend.name)
            return None
        t0 = time.perf_counter()
        graphs = DecodeGraphs(self.model, self.model_runner.kv_caches,
                              capture_sizes(self.scheduler_config.max_num_seqs),
                              self.max_model_len, self.args.block_size, self.device)
        graphs.capture()
        logger.info("captured CUDA graphs of decode steps for %d batch sizes (1..%d) in %.1f s",
                    len(graphs.sizes), graphs.max_batch_size, time.perf_counter() - t0)
        return graphs

    def _eos_token_id(self) -> int | None:
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            return self.tokenizer.eos_token_id
        eos = getattr(self.hf_config, "eos_token_id", None)
        return eos[0] if isinstance(eos, list) else eos

    def _extra_eos_token_ids(self) -> list[int]:
        """End-of-sequence ids that ``generation_config.json`` lists besides the main one
        (Llama 3 and Qwen2.5 chat models end turns with them). As vLLM does, requests
        stop on them unless ``ignore_eos``."""
        path = self.model_path / "generation_config.json"
        if not path.is_file():
            return []
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
        return [t for t in ids if t != self.eos_token_id]

    # -- requests -----------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        """Queue a request. Raises ``ValueError`` for a bad prompt or parameters; nothing is
        queued then."""
        if request_id in self.output_processor.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self._truncate(*self._tokenize(prompt), params.truncate_prompt_tokens)
        params = self._check_params(token_ids, params)
        if self.extra_eos_token_ids and not params.ignore_eos:
            params = replace(params, stop_token_ids=[
                *params.stop_token_ids,
                *(t for t in self.extra_eos_token_ids if t not in params.stop_token_ids)])
        grammars = self.structured_output.request_grammars(params, params.n)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        children = []
        for i in range(params.n):
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = replace(params, seed=params.seed + i)  # distinct, reproducible
            child_id = request_id if params.n == 1 else f"{i}_{request_id}"
            generator = (make_generator(child_params.seed, self.device)
                         if child_params.seed is not None else None)
            children.append(Request(child_id, token_ids, child_params, self.eos_token_id,
                                    arrival, generator, grammars[i]))
        parent = ParentState(request_id, text, token_ids, params, RequestMetrics(arrival))
        self.output_processor.add_request(parent, children)
        self.scheduler.add_request(children[0], forks=children[1:])

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        text = None
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:  # with an optional "prompt": its text
                text = prompt.get("prompt")
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a dict prompt needs 'prompt_token_ids' or 'prompt'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer (skip_tokenizer_init=True given)")
            return prompt, encode_text(self.tokenizer, prompt)
        if not isinstance(prompt, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            raise ValueError("prompt must be a string, a list of token ids or a dict")
        bad = [t for t in prompt if not 0 <= t < self.hf_config.vocab_size]
        if bad:
            raise ValueError(
                f"token id {bad[0]} is out of the vocabulary [0, {self.hf_config.vocab_size})")
        return text, prompt

    def _truncate(self, text: str | None, token_ids: list[int], keep: int | None
                  ) -> tuple[str | None, list[int]]:
        """The last ``keep`` prompt tokens (vLLM's ``truncate_prompt_tokens``: -1 means
        ``max_model_len``). The text is dropped when tokens are cut: it would no longer
        match the ids (``echo`` then decodes the ids kept). Raises ``ValueError`` when
        ``keep`` > ``max_model_len``."""
        if keep is None:
            return text, token_ids
        if keep > self.max_model_len:
            raise ValueError(f"truncate_prompt_tokens must be <= max_model_len "
                             f"({self.max_model_len}) or -1; got {keep}")
        keep = self.max_model_len if keep == -1 else keep
        if len(token_ids) <= keep:
            return text, token_ids
        return None, token_ids[-keep:]

    def _check_params(self, token_ids: list[int], params: SamplingParams) -> SamplingParams:
        if not token_ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        room = self.max_model_len - len(token_ids)
        if room < 1:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len}, "
                "so no token can be generated")
        if params.max_tokens is None:
            params = replace(params, max_tokens=room)
        elif params.max_tokens > room:
            raise ValueError(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len ({self.max_model_len})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.args.max_logprobs:
                raise ValueError(f"{name} must be <= max_logprobs ({self.args.max_logprobs}), got {value}")
        vocab = self.hf_config.vocab_size
        for name, ids in (("logit_bias", params.logit_bias or ()),
                          ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{name}: token id {bad[0]} is out of the vocabulary [0, {vocab})")
        if params.n > self.scheduler_config.max_num_seqs:
            raise ValueError(
                f"n must be <= max_num_seqs ({self.scheduler_config.max_num_seqs}), got {params.n}")
        if params.min_tokens > params.max_tokens:
            raise ValueError(f"min_tokens ({params.min_tokens}) must be <= max_tokens ({params.max_tokens})")
        return params

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
            out = self.model_runner.execute_model(sched)
        except Exception:
            # Blocks published to the prefix cache in this step were never filled.
            self.kv_cache_manager.pool.reset_prefix_cache()
            raise
        self.scheduler.update_from_output(sched, out.sampled)
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

    def kv_cache_stats(self) -> KVCacheStats:
        num_tokens = sum(r.num_computed_tokens for r in self.scheduler.running)
        return self.kv_cache_manager.stats(num_tokens)

