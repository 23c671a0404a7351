"""glibc's allocator told to keep the memory a step frees, for the next step, and to hand
back what loading and profiling freed.

A prefill step of a 1B-class model allocates activations of tens of MiB per layer (the
gate/up product of 2,048 tokens x 16,384 columns in bfloat16: 64 MiB) and frees them a few
microseconds later. With glibc's defaults such blocks are handed back to the kernel
(unmapped, or trimmed from the heap's top) or left unused while the heap grows past them,
so every step faults fresh pages in and the kernel clears each one (a loop of such steps:
16-28 thousand minor faults a step, never fewer; ``clear_page_erms`` and the fault path:
5-9% of the 1B's samples under ``perf``). The three settings below (``mallopt(3)``:
``M_MMAP_THRESHOLD``, ``M_TRIM_THRESHOLD``, ``M_TOP_PAD``) keep blocks under 1 GiB in the
heap and the heap from shrinking: after a few steps the loop faults nothing. The process's
resident memory stays at its peak, as with the tcmalloc that vLLM's CPU backend preloads.
The 1B workload in bfloat16: 1.08-1.15x output tok/s (``benchmarks/README.md``, eighteenth
session).

Applies only where the C library is glibc and the user set none of glibc's ``MALLOC_*``
variables for these settings (theirs win).
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

logger = logging.getLogger(__name__)

# <malloc.h>
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
SETTINGS = {
    M_MMAP_THRESHOLD: 1 << 30,   # bytes: blocks under 1 GiB come from the heap
    M_TRIM_THRESHOLD: 2**31 - 1,  # bytes (mallopt takes an int): the heap's top is kept
    M_TOP_PAD: 256 << 20,        # bytes added to each growth of the heap
}
USER_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def keep_freed_host_memory() -> bool:
    """Set ``SETTINGS`` with glibc's ``mallopt``; returns whether they were set (False off
    glibc, or where the user set one of ``USER_VARIABLES``). Process-wide, idempotent."""
    if platform.libc_ver()[0] != "glibc" or any(v in os.environ for v in USER_VARIABLES):
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    failed = [param for param, value in SETTINGS.items() if mallopt(param, value) != 1]
    if failed:
        logger.warning("mallopt refused parameters %s: freed memory may be faulted in again",
                       failed)
    return not failed


def release_freed_memory() -> None:
    """Hand the heap pages freed while loading (float weights a method replaced, file
    bytes) or profiling back to the OS: glibc keeps them in the process otherwise,
    resident. With ``--quantization mxfp4`` on the bundled model the process held 621 MiB
    after loading, 441 MiB after ``malloc_trim(0)`` (glibc's ``malloc.h``; a no-op
    elsewhere). ``malloc_trim`` hands them back whatever ``M_TRIM_THRESHOLD`` is."""
    libc = ctypes.CDLL(None)
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
