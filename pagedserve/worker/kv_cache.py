"""Allocates the per-layer K/V block tensors and decides how many blocks fit.

Layout per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (index 0 = K,
1 = V). One block of one layer holds ``block_size`` tokens' keys and values.
"""

from __future__ import annotations

import logging
import math
import mmap

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


def available_memory_bytes() -> int:
    """``MemAvailable`` of /proc/meminfo, lowered to the cgroup limit where one is set."""
    avail = None
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    if avail is None:
        raise RuntimeError("MemAvailable not found in /proc/meminfo")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read())
        if limit != "max":
            avail = min(avail, int(limit) - used)
    except OSError:
        pass
    return avail


def num_kv_blocks(cache: CacheConfig, config, dtype: torch.dtype, max_model_len: int) -> int:
    """Blocks in the pool: the override, else ``kv_cache_memory_bytes``, else vLLM's CPU
    default (4 GiB) capped at half the available memory.

    Raises ``ValueError`` when the pool cannot hold one ``max_model_len`` sequence.
    """
    per_block = bytes_per_block(config, cache.block_size, dtype)
    if cache.num_gpu_blocks_override is not None:
        num_blocks = cache.num_gpu_blocks_override
    else:
        budget = cache.kv_cache_memory_bytes
        if budget is None:
            budget = min(DEFAULT_CPU_KV_BYTES, available_memory_bytes() // 2)
        num_blocks = budget // per_block
    needed = -(-max_model_len // cache.block_size)
    if num_blocks < needed:
        raise ValueError(
            f"the KV cache has room for {num_blocks} blocks ({num_blocks * cache.block_size} "
            f"tokens) but one sequence of max_model_len={max_model_len} needs {needed} blocks; "
            "lower max_model_len or give the KV cache more memory (kv_cache_memory_bytes)"
        )
    return num_blocks


def allocate_kv_caches(config, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: str) -> list[torch.Tensor]:
    """One zeroed ``[2, num_blocks, block_size, kv_heads, head_dim]`` tensor per layer.

    Zeros matter: padded reads of never-written slots must be finite (they are masked,
    but 0 * NaN is NaN). On CPU the tensors live in anonymous ``mmap`` memory, which the
    kernel zeroes lazily, so a large pool costs RAM only as blocks are first written.
    """
    layers, kv_heads, head_dim = kv_shape(config)
    shape = (2, num_blocks, block_size, kv_heads, head_dim)
    if not device.startswith("cpu"):
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    caches = []
    for _ in range(layers):
        buf = mmap.mmap(-1, nbytes)  # the tensor keeps the buffer alive
        caches.append(torch.frombuffer(buf, dtype=dtype, count=numel).view(shape))
    return caches
