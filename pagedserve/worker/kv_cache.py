"""Allocates the per-layer K/V block tensors and decides how many blocks fit.

Layout per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (index 0 = K,
1 = V). One block of one layer holds ``block_size`` tokens' keys and values.
"""

from __future__ import annotations

import logging
import math
import mmap
from dataclasses import dataclass

import torch

from pagedserve.config import CacheConfig

logger = logging.getLogger(__name__)

# vLLM's CPU backend default KV space (VLLM_CPU_KVCACHE_SPACE = 4 GiB).
DEFAULT_CPU_KV_BYTES = 4 << 30


def kv_shape(config) -> tuple[int, int, int]:
    """``(num_layers, num_kv_heads, head_dim)`` of a transformers config."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return config.num_hidden_layers, kv_heads, head_dim


def bytes_per_block(config, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V for one block across all layers:
    ``2 * layers * block_size * kv_heads * head_dim * element_size``."""
    layers, kv_heads, head_dim = kv_shape(config)
    return 2 * layers * block_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def _proc_bytes(path: str, field: str) -> int:
    """A ``Field:  N kB`` line of a /proc file (``/proc/meminfo``, ``/proc/self/status``)
    in bytes."""
    with open(path) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not found in {path}")


def _cgroup_limit() -> tuple[int, int] | None:
    """``(limit, current usage)`` in bytes of this process's cgroup v2, if it sets a limit."""
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read())
    except OSError:
        return None
    return None if limit == "max" else (int(limit), used)


def total_memory_bytes() -> int:
    """The machine's RAM (``MemTotal``), or the cgroup limit where one is lower."""
    total = _proc_bytes("/proc/meminfo", "MemTotal")
    cgroup = _cgroup_limit()
    return min(total, cgroup[0]) if cgroup else total


def available_memory_bytes() -> int:
    """``MemAvailable``, lowered to what the cgroup limit leaves where one is set."""
    avail = _proc_bytes("/proc/meminfo", "MemAvailable")
    cgroup = _cgroup_limit()
    return min(avail, cgroup[0] - cgroup[1]) if cgroup else avail


def measure_cpu_peak(fn) -> int:
    """Bytes of resident memory that ``fn()`` adds at its peak above the current RSS.

    Resets the kernel's high-water mark (``VmHWM``) by writing 5 to
    ``/proc/self/clear_refs`` (Linux >= 4.0, proc(5)); where that is refused, the mark
    from earlier in the process stands and the result can only be larger (safe).
    """
    base = _proc_bytes("/proc/self/status", "VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        logger.warning("cannot reset VmHWM; the activation peak may be overestimated")
    fn()
    return max(_proc_bytes("/proc/self/status", "VmHWM") - base, 0)


@dataclass(frozen=True)
class MemoryProfile:
    """How the KV pool was sized (bytes). ``kv_budget`` is what the pool may take."""

    total: int
    weights: int
    peak_activation: int
    kv_budget: int
    bytes_per_block: int
    source: str  # "override", "kv_cache_memory_bytes", "gpu_memory_utilization", "cpu_default",
                 # "memory_budget"


def cpu_kv_budget(cache: CacheConfig, weights: int, peak_activation: int) -> tuple[int, int]:
    """``(total, kv_budget)`` on CPU with ``gpu_memory_utilization`` u: the engine may use
    u x RAM (or the cgroup limit), so ``kv_budget = u * total - weights - peak_activation``."""
    total = total_memory_bytes()
    return total, int(cache.gpu_memory_utilization * total) - weights - peak_activation


# What a serving process gains after its KV cache is sized, besides activations and KV
# blocks: the HTTP app, request and output state, its threads' allocator arenas. Measured
# on the bundled model without it: a server with 8 requests in flight peaked 12 MiB above
# its budget (tests/test_memory_budget.py).
SERVING_RESERVE = 32 << 20


def resident_within_budget(budget: int, weights: int) -> int:
    """This process's resident memory after loading (``VmRSS``: interpreter, libraries,
    weights) plus ``SERVING_RESERVE``, in bytes. Raises ``ValueError`` naming the numbers
    when that leaves nothing of ``budget`` (``--memory-budget``) for activations and the KV
    cache."""
    held = _proc_bytes("/proc/self/status", "VmRSS") + SERVING_RESERVE
    if held >= budget:
        raise ValueError(
            f"--memory-budget {budget / 2**20:.0f} MiB does not hold the loaded model: the "
            f"process holds {held / 2**20:.0f} MiB after loading (weights "
            f"{weights / 2**20:.0f} MiB, {SERVING_RESERVE >> 20} MiB kept for serving, the "
            "rest the interpreter and libraries), before any activation or KV cache; raise "
            "the budget or choose a smaller quantization")
    return held


def cpu_default_kv_budget() -> int:
    """The CPU KV budget without ``gpu_memory_utilization``: vLLM's CPU default of a fixed
    4 GiB (``VLLM_CPU_KVCACHE_SPACE``), which, like vLLM's CPU worker, needs no profiling
    forward pass; capped at half of ``MemAvailable`` because the machine is shared and the
    other half is left for activations (bytes)."""
    return min(DEFAULT_CPU_KV_BYTES, available_memory_bytes() // 2)


def fixed_kv_budget(cache: CacheConfig, per_block: int, device: str, num_ranks: int = 1
                    ) -> tuple[int, str] | None:
    """``(kv_budget in bytes, source)`` where no profiling forward pass is needed: the block
    override, ``kv_cache_memory_bytes`` (per rank, as vLLM's), or on CPU without
    ``gpu_memory_utilization`` or ``memory_budget`` the default shared by the engine's
    ``num_ranks`` ranks (each rank's blocks are ``1 / num_ranks`` of the model's KV heads,
    so the pool keeps its size in tokens). None when the budget must be profiled."""
    if cache.num_gpu_blocks_override is not None:
        return cache.num_gpu_blocks_override * per_block, "override"
    if cache.kv_cache_memory_bytes is not None:
        return cache.kv_cache_memory_bytes, "kv_cache_memory_bytes"
    if device == "cpu" and cache.gpu_memory_utilization is None and cache.memory_budget is None:
        return cpu_default_kv_budget() // num_ranks, "cpu_default"
    return None


def num_kv_blocks(cache: CacheConfig, per_block: int, budget: int, max_model_len: int,
                  what_to_lower: str) -> int:
    """``budget // per_block`` blocks, or the override.

    Raises ``ValueError`` (naming ``what_to_lower``) when the pool cannot hold one
    ``max_model_len`` sequence.
    """
    if cache.num_gpu_blocks_override is not None:
        num_blocks = cache.num_gpu_blocks_override
    else:
        num_blocks = max(budget, 0) // per_block
    needed = -(-max_model_len // cache.block_size)
    if num_blocks < needed:
        raise ValueError(
            f"the KV cache has room for {num_blocks} blocks ({num_blocks * cache.block_size} "
            f"tokens; budget {budget / 2**20:.0f} MiB) but one sequence of "
            f"max_model_len={max_model_len} needs {needed} blocks; lower max_model_len or "
            f"{what_to_lower}"
        )
    return num_blocks


def allocate_kv_caches(config, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: str) -> list[torch.Tensor]:
    """One zeroed ``[2, num_blocks, block_size, kv_heads, head_dim]`` tensor per layer.

    Zeros matter: padded reads of never-written slots must be finite (they are masked,
    but 0 * NaN is NaN). On CPU the tensors live in anonymous ``mmap`` memory, which the
    kernel zeroes lazily, so a large pool costs RAM only as blocks are first written.
    Private, not shared (Python's default): a first write into a private page faults in
    1.3 us against 2.1 for shmem's (Zen 5 VM; ~120k such faults in a fresh engine's first
    workload run, on the step's time). Workers are spawned, never forked, so no copy-on-write.
    """
    layers, kv_heads, head_dim = kv_shape(config)
    shape = (2, num_blocks, block_size, kv_heads, head_dim)
    if not device.startswith("cpu"):
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    caches = []
    for _ in range(layers):
        # the tensor keeps the buffer alive
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        caches.append(torch.frombuffer(buf, dtype=dtype, count=numel).view(shape))
    return caches


# -- CUDA sizing (only called when the engine runs on a CUDA device) -------------------------

# vLLM's default --gpu-memory-utilization.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


def measure_cuda_peak(fn, device) -> int:
    """Bytes of device memory that ``fn()`` allocates at its peak above what PyTorch holds
    before it (``torch.cuda.max_memory_allocated`` after a reset of the peak counter)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    torch.cuda.empty_cache()
    return max(peak, 0)


def cuda_kv_budget(cache: CacheConfig, peak_activation: int, device) -> tuple[int, int, str]:
    """``(total, kv_budget, source)`` on a CUDA device, as vLLM sizes it.

    The engine may use ``u * total`` of the device (``u`` = ``gpu_memory_utilization``,
    default 0.9). What is in use now (``total - free`` from ``torch.cuda.mem_get_info``,
    after returning PyTorch's cached blocks: weights, the CUDA context and libraries'
    workspaces, other processes on the device) and the activation peak of the profiled
    step are subtracted::

        kv_budget = u * total - (total - free) - peak_activation

    Call it after the profiling forward and once its scratch KV blocks are freed.
    """
    u = cache.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    budget = int(u * total) - (total - free) - peak_activation
    logger.info("CUDA memory: %.2f GiB total, %.2f GiB in use, activation peak %.2f GiB, "
                "utilization %.2f -> KV budget %.2f GiB", total / 2**30, (total - free) / 2**30,
                peak_activation / 2**30, u, budget / 2**30)
    return total, budget, "gpu_memory_utilization"
