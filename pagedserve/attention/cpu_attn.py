"""Paged attention on CPU through a C++ kernel (``csrc/paged_attention_cpu.cpp``).

The kernel reads each sequence's K/V straight from its blocks, so a decode step costs
no gathered copy of the context. It handles any query length (tests check prefill rows
too); the backend routes only decodes to it. It is compiled with ``torch.utils.cpp_extension`` on
first use (about a minute on two cores; ``setup.sh`` does it once) and cached under
torch's extensions folder, keyed by the source and this CPU's instruction-set flags
(it is built with ``-march=native``).
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path

import torch

from pagedserve.attention.backend import AttentionMetadata
from pagedserve.attention.torch_attn import TorchAttention
from pagedserve.config import cpu_flags

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"


@functools.cache
def load_extension():
    """Compile (first time) and import the kernel. Raises RuntimeError/OSError if the
    toolchain is missing."""
    from torch.utils.cpp_extension import load

    flags = " ".join(sorted(cpu_flags())).encode()
    key = hashlib.sha256(_SOURCE.read_bytes() + flags).hexdigest()[:12]
    return load(
        name=f"pagedserve_cpu_attn_{key}",
        sources=[str(_SOURCE)],
        extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )


def cpu_kernel_available() -> bool:
    """True if the kernel builds and loads here (logs why not otherwise)."""
    try:
        load_extension()
    except (RuntimeError, OSError, ImportError) as e:
        logger.warning("CPU paged-attention kernel unavailable, using PyTorch: %s", e)
        return False
    return True


class CpuAttention(TorchAttention):
    """The C++ kernel for decodes (6x faster than gather + SDPA at batch 64 here);
    prefills keep PyTorch's fused attention, which is faster for long query blocks."""

    name = "cpu"

    def __init__(self) -> None:
        self.ops = load_extension()

    def forward(self, query, kv_cache, meta: AttentionMetadata, scale, sliding_window=None):
        out = torch.empty_like(query)
        nd = meta.num_decodes
        if nd:
            self.ops.paged_attention(
                query[:nd].contiguous(), kv_cache, meta.block_tables[:nd], meta.seq_lens[:nd],
                meta.query_start_loc[: nd + 1], out[:nd], scale, sliding_window or 0)
        self._prefill(query, kv_cache, meta, scale, sliding_window, out)
        return out
