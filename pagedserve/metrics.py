"""Prometheus metrics with vLLM's own names, so vLLM dashboards and tools work unchanged.

Names, help texts, buckets and labels follow vLLM v1 (``vllm/v1/metrics/loggers.py``,
``PrometheusStatLogger``); every series carries the labels ``model_name`` (the served model
name) and ``engine`` (``"0"``, or the replica's index with ``--data-parallel-size``), except the info gauge
``vllm:cache_config_info`` (``engine`` and the cache configuration, as vLLM). Counters are
exposed with prometheus-client's ``_total`` suffix (``vllm:prompt_tokens_total``), as vLLM's
are.

The engine loop computes plain stats objects (``SchedulerStats`` when a step is scheduled,
so a request in the step being computed counts as running, and again after the step;
``IterationStats`` per step, ``FinishedRequestStats`` per finished request) and hands them
to ``PrometheusStatLogger.record``; the collectors are thread-safe, and ``/metrics`` renders
them with ``render()``. Times are seconds on the ``time.monotonic`` clock.

With LoRA (``max_lora`` given) there is also vLLM's ``vllm:lora_requests_info``: a gauge
without ``model_name`` / ``engine`` labels whose labels are ``max_lora`` (``--max-loras``),
``running_lora_adapters`` and ``waiting_lora_adapters`` (the adapter names of the running
and waiting requests, sorted and comma-joined; "" for none) and whose value is the Unix time
of the update; each update sets the series of the current labels, so the newest value marks
the current state (the Gateway API inference extension reads it that way).

pagedserve extra (not a vLLM name): ``pagedserve:iteration_num_seqs``, a histogram of the
number of sequences that produced a token in one engine step (the decode batch size).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import prometheus_client
from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)

FINISH_REASONS = ("stop", "length", "abort")

_REQUEST_LATENCY_BUCKETS = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
]
_TTFT_BUCKETS = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]
_ITL_BUCKETS = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
]
_ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
_BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]


@dataclass
class SchedulerStats:
    """Engine state after a step (gauges) and cumulative cache counters.

    ``kv_cache_usage`` is the fraction (0-1) of KV blocks held by requests;
    ``prefix_cache_queries`` / ``prefix_cache_hits`` are cumulative token counts and
    ``num_preemptions`` a cumulative count (the logger turns them into counter increments).
    ``running_lora_adapters`` / ``waiting_lora_adapters`` count the running and waiting
    requests per LoRA adapter name (base-model requests are not counted), as vLLM's
    ``IterationStats`` do; None when the engine serves no adapters.
    """

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    spec_decoding: SpecDecodingStats | None = None  # cumulative; None: no speculation
    # LoRA adapter name -> requests running / waiting with it; None: LoRA is off
    running_lora_adapters: dict[str, int] | None = None
    waiting_lora_adapters: dict[str, int] | None = None


@dataclass
class SpecDecodingStats:
    """Speculative decoding's cumulative counts (vLLM's ``SpecDecodingStats``): requests
    that verified drafts (``num_drafts``, once per request and step), draft tokens
    verified, drafts accepted, and accepted drafts by position (0 = the first draft)."""

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One request verified ``num_draft_tokens`` drafts and kept the first
        ``num_accepted``."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / verified draft tokens (None before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    def copy(self) -> SpecDecodingStats:
        return replace(self, num_accepted_tokens_per_pos=list(self.num_accepted_tokens_per_pos))

    def __add__(self, other: SpecDecodingStats) -> SpecDecodingStats:
        """Field by field (two engines' counts)."""
        return self._combine(other, 1)

    def __sub__(self, other: SpecDecodingStats) -> SpecDecodingStats:
        """Field by field (what the counts gained since ``other``, an earlier copy)."""
        return self._combine(other, -1)

    def _combine(self, other: SpecDecodingStats, sign: int) -> SpecDecodingStats:
        return SpecDecodingStats(
            self.num_spec_tokens,
            self.num_drafts + sign * other.num_drafts,
            self.num_draft_tokens + sign * other.num_draft_tokens,
            self.num_accepted_tokens + sign * other.num_accepted_tokens,
            [a + sign * b for a, b in zip(self.num_accepted_tokens_per_pos,
                                          other.num_accepted_tokens_per_pos)])


@dataclass
class FinishedRequestStats:
    """One request's totals when it ends (``finish_reason`` is stop, length or abort)."""

    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    max_tokens_param: int | None
    n_param: int = 1
    queued_time: float = 0.0
    prefill_time: float = 0.0
    inference_time: float = 0.0
    decode_time: float = 0.0


@dataclass
class IterationStats:
    """What one engine step produced.

    ``num_prompt_tokens`` counts the prompts of requests that got their first token in this
    step (vLLM's accounting), ``num_generation_tokens`` the tokens sampled, ``num_seqs`` the
    sequences that produced a token; latencies are in seconds.
    """

    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_seqs: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's buckets for token counts)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class PrometheusStatLogger:
    """vLLM's Prometheus collectors for one served model, in their own registry.

    Args:
        model_name: value of the ``model_name`` label (the served model name).
        max_model_len: longest sequence in tokens (sizes the token-count buckets).
        registry: where to register; a fresh ``CollectorRegistry`` (with the process,
            platform and GC collectors that prometheus-client's default registry has) when
            None, so several servers can live in one process (tests).
        engine_indexes: the engines (data-parallel replicas) whose series are exported, each
            labelled ``engine="<index>"`` as vLLM's; there is no unlabelled sum.
        max_lora: ``--max-loras`` when the engine serves LoRA adapters (exports
            ``vllm:lora_requests_info``), else None.

    Raises ``ValueError`` for ``max_lora`` with several engines (LoRA is served by one).
    """

    def __init__(self, model_name: str, max_model_len: int,
                 registry: CollectorRegistry | None = None,
                 engine_indexes: Sequence[int] = (0,), max_lora: int | None = None) -> None:
        if registry is None:
            registry = CollectorRegistry(auto_describe=True)
            for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
                try:
                    registry.register(collector)
                except ValueError:  # pragma: no cover - already there
                    pass
        self.registry = registry
        self.engine_indexes = list(engine_indexes)
        families: dict[str, object] = {}

        def family(cls, name: str, doc: str, extra_labels: tuple[str, ...] = (), **kwargs):
            """One metric family per name, shared by the engines' labelled series."""
            if name not in families:
                families[name] = cls(name, doc, ["model_name", "engine", *extra_labels],
                                     registry=registry, **kwargs)
            return families[name]

        self._engines = {i: _EngineMetrics(family, model_name, str(i), max_model_len)
                         for i in self.engine_indexes}
        self.max_lora = max_lora
        self._lora_info: Gauge | None = None
        if max_lora is not None:
            if len(self.engine_indexes) > 1:
                raise ValueError("vllm:lora_requests_info: LoRA adapters are served by one "
                                 "engine, not data-parallel replicas")
            self._lora_info = Gauge(
                "vllm:lora_requests_info", "Running stats on lora requests.",
                ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                registry=registry)

    def log_cache_config_info(self, info: Mapping[str, str]) -> None:
        """Export ``vllm:cache_config_info``: a gauge of value 1 whose labels are the KV
        cache configuration (``LLMEngine.cache_config_info()``: block_size, num_gpu_blocks,
        cache_dtype, enable_prefix_caching, gpu_memory_utilization, ...) plus ``engine``,
        as vLLM's ``PrometheusStatLogger.log_metrics_info``; call it once."""
        info_gauge = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                           [*info, "engine"], registry=self.registry)
        for i in self.engine_indexes:
            info_gauge.labels(**info, engine=str(i)).set(1)

    def record(self, scheduler_stats: SchedulerStats | None,
               iteration_stats: IterationStats | None, engine_idx: int = 0) -> None:
        """Update engine ``engine_idx``'s series; safe to call from the engine thread (or a
        replica's reader thread) while scraped."""
        self._engines[engine_idx].record(scheduler_stats, iteration_stats)
        if (self._lora_info is not None and scheduler_stats is not None
                and scheduler_stats.running_lora_adapters is not None):
            self._lora_info.labels(
                max_lora=str(self.max_lora),
                waiting_lora_adapters=",".join(sorted(scheduler_stats.waiting_lora_adapters or {})),
                running_lora_adapters=",".join(sorted(scheduler_stats.running_lora_adapters)),
            ).set_to_current_time()

    def render(self) -> bytes:
        """The registry in Prometheus text exposition format (``CONTENT_TYPE``)."""
        return prometheus_client.generate_latest(self.registry)

    CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST


class _EngineMetrics:
    """The series of one engine (``engine="<index>"``) and its last cumulative stats."""

    def __init__(self, family: Callable, model_name: str, engine: str,
                 max_model_len: int) -> None:
        values = (model_name, engine)

        def gauge(name: str, doc: str) -> Gauge:
            return family(Gauge, name, doc).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return family(Counter, name, doc).labels(*values)

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return family(Histogram, name, doc, buckets=buckets).labels(*values)

        self.num_requests_running = gauge("vllm:num_requests_running",
                                          "Number of requests in model execution batches.")
        self.num_requests_waiting = gauge("vllm:num_requests_waiting",
                                          "Number of requests waiting to be processed.")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc",
                                    "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.num_preemptions = counter("vllm:num_preemptions",
                                       "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens",
                                         "Number of generation tokens processed.")
        success = family(Counter, "vllm:request_success",
                         "Count of successfully processed requests.", ("finished_reason",))
        self.request_success = {r: success.labels(*values, r) for r in FINISH_REASONS}

        token_buckets = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets)
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.",
            token_buckets)
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
            _ITERATION_TOKEN_BUCKETS)
        self.request_params_n = histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.", [1, 2, 5, 10, 20])
        self.request_params_max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
            token_buckets)
        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            _TTFT_BUCKETS)
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            _ITL_BUCKETS)
        self.e2e_request_latency = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
            _REQUEST_LATENCY_BUCKETS)
        self.request_queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.", _REQUEST_LATENCY_BUCKETS)
        self.request_inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.", _REQUEST_LATENCY_BUCKETS)
        self.request_prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.", _REQUEST_LATENCY_BUCKETS)
        self.request_decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.", _REQUEST_LATENCY_BUCKETS)
        self.iteration_num_seqs = histogram(
            "pagedserve:iteration_num_seqs",
            "Histogram of the number of sequences that produced a token per engine step.",
            _BATCH_BUCKETS)
        self._family, self._values = family, values
        self._spec: tuple | None = None  # the spec-decode counters, made on first use
        self._last = SchedulerStats()

    def _record_spec(self, now: SpecDecodingStats, last: SpecDecodingStats | None) -> None:
        """vLLM's ``vllm:spec_decode_*`` counters, incremented by what ``now`` adds to
        ``last`` (made with the first stats, so an engine without speculation has none)."""
        if self._spec is None:
            def counter(name: str, doc: str, *labels: str):
                return self._family(Counter, name, doc, labels)

            self._spec = (
                counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
                counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
                counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."),
                counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                        "Accepted tokens per draft position.", "position"))
        gained = now - (last or SpecDecodingStats(now.num_spec_tokens))
        drafts, draft_tokens, accepted, per_pos = self._spec
        drafts.labels(*self._values).inc(gained.num_drafts)
        draft_tokens.labels(*self._values).inc(gained.num_draft_tokens)
        accepted.labels(*self._values).inc(gained.num_accepted_tokens)
        for pos, n in enumerate(gained.num_accepted_tokens_per_pos):
            per_pos.labels(*self._values, str(pos)).inc(n)

    def record(self, scheduler_stats: SchedulerStats | None,
               iteration_stats: IterationStats | None) -> None:
        if scheduler_stats is not None:
            s, last = scheduler_stats, self._last
            self.num_requests_running.set(s.num_running_reqs)
            self.num_requests_waiting.set(s.num_waiting_reqs)
            self.kv_cache_usage.set(s.kv_cache_usage)
            self.prefix_cache_queries.inc(max(0, s.prefix_cache_queries - last.prefix_cache_queries))
            self.prefix_cache_hits.inc(max(0, s.prefix_cache_hits - last.prefix_cache_hits))
            self.num_preemptions.inc(max(0, s.num_preemptions - last.num_preemptions))
            if s.spec_decoding is not None:
                self._record_spec(s.spec_decoding, last.spec_decoding)
            self._last = s
        if iteration_stats is None:
            return
        it = iteration_stats
        self.prompt_tokens.inc(it.num_prompt_tokens)
        self.generation_tokens.inc(it.num_generation_tokens)
        if it.num_prompt_tokens or it.num_generation_tokens:
            self.iteration_tokens.observe(it.num_prompt_tokens + it.num_generation_tokens)
        if it.num_seqs:
            self.iteration_num_seqs.observe(it.num_seqs)
        for ttft in it.time_to_first_tokens:
            self.time_to_first_token.observe(ttft)
        for itl in it.inter_token_latencies:
            self.inter_token_latency.observe(itl)
        for f in it.finished_requests:
            self.request_success.get(f.finish_reason, self.request_success["stop"]).inc()
            self.e2e_request_latency.observe(f.e2e_latency)
            self.request_queue_time.observe(f.queued_time)
            self.request_prefill_time.observe(f.prefill_time)
            self.request_inference_time.observe(f.inference_time)
            self.request_decode_time.observe(f.decode_time)
            self.request_prompt_tokens.observe(f.num_prompt_tokens)
            self.request_generation_tokens.observe(f.num_generation_tokens)
            self.request_params_n.observe(f.n_param)
            if f.max_tokens_param:
                self.request_params_max_tokens.observe(f.max_tokens_param)
