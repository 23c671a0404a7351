"""Which of our batch-invariant kernels a bfloat16 or int8 weight runs on this CPU: timed
once at load on the model's own shapes, then kept.

Our fixed-order GEMM (``csrc/fixed_order_gemm_cpu.cpp``) holds a bfloat16 weight in one of
two layouts, each batch-invariant by construction (a row's bits never depend on the rows
beside it):

- ``fma``: float32 FMA chains over K (every CPU);
- ``pairs``: ``vdpbf16ps`` chains over k-pairs (CPUs with AVX512-BF16), twice the products
  per instruction;
- ``amx``: the pairs' layout in k-steps of 16 pairs, summed by AMX tiles (``TDPBF16PS``,
  CPUs with AMX and K a multiple of 32; ``csrc/amx_tiles.h``), 16 times the products of
  ``vdpbf16ps`` per instruction.

Libraries (MKL, oneDNN) are not candidates: they pick summation orders by the row count
(``benchmarks/packed_gemm.py`` measures them as the peak our kernels are held against).
The layouts give different bits, so a machine must make the same choice on every
start: each weight shape is timed once (a few ms to a second), the winner is written to
``cache_dir()/kernel_choice.json`` under this CPU's model, flags, torch version, thread
count and kernel sources, and later starts read it (a noisy timing decides once, it never
flips while the code stays the same).

An int8 weight has two products with the same bits (an int32 sum is exact in any order),
so its choice (``int8.int8_kernel``, by ``choose`` and ``time_routes`` here) is speed alone.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import pathlib
import tempfile
import time

import torch

from pagedserve.config import cpu_flags, cpu_model
from pagedserve.cpu_ops import load_cpu_ops, sources_digest
from pagedserve.tokenizer import cache_dir

logger = logging.getLogger(__name__)

# Rows timed per candidate: a decode step's and a prefill chunk's; at most this many of a
# weight's output columns (a wide LM head's rate is its slices' rate: timing all 49,152
# columns of a 1B model's took seconds of start-up).
_TIMED_ROWS = (16, 128)
TIMED_COLUMNS = 4096
# Timed calls per candidate and row count, the candidates taking turns: a slow moment of a
# shared host then falls on each of them, and the best of the calls is kept.
_TIMED_CALLS = 5


def machine_key() -> str:
    """What a cached choice is valid for: CPU model, flags, torch version, threads, the
    kernels' sources and this file's (a changed kernel, or a changed way of timing, is
    timed again)."""
    flags = hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:12]
    rule = hashlib.sha256(pathlib.Path(__file__).read_bytes()).hexdigest()[:12]
    return f"{cpu_model()} | flags {flags} | torch {torch.__version__} | " \
           f"{torch.get_num_threads()} threads | kernels {sources_digest()} | rule {rule}"


def _cache_file():
    return cache_dir() / "kernel_choice.json"


def _read_cache() -> dict:
    try:
        return json.loads(_cache_file().read_text())
    except (OSError, ValueError):
        return {}


def _write_cache(cache: dict) -> None:
    """Atomically (a temporary file renamed), so that two engines starting together never
    read half a file."""
    path = _cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(cache, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def _seconds(multiply, x: torch.Tensor) -> float:
    """One call's wall time, in seconds."""
    start = time.perf_counter()
    multiply(x)
    return time.perf_counter() - start


def time_routes(routes: dict, k: int, dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """Seconds per route (``routes``: name -> a product of ``x [rows, k]``): the geometric
    mean over ``_TIMED_ROWS`` of each one's best call, after a warm-up call of each. A
    geometric mean weighs a decode step's rows as much as a prefill chunk's; in a sum the
    chunk's time drowns the step's, and on a noisy Zen 5 host one such sum (three calls a
    route in a row) chose oneDNN's int8 product for a weight ours multiplies 1.2-1.7x
    faster at 16-64 rows (4% slower at 128)."""
    gen = torch.Generator().manual_seed(0)
    log_sum = dict.fromkeys(routes, 0.0)
    for rows in _TIMED_ROWS:
        x = torch.randn(rows, k, generator=gen).to(dtype)
        for multiply in routes.values():
            multiply(x)
        best = dict.fromkeys(routes, math.inf)
        for _ in range(_TIMED_CALLS):
            for name, multiply in routes.items():
                best[name] = min(best[name], _seconds(multiply, x))
        for name, seconds in best.items():
            log_sum[name] += math.log(seconds)
    return {name: math.exp(total / len(_TIMED_ROWS)) for name, total in log_sum.items()}


def _time_layouts(weight: torch.Tensor) -> dict[str, float]:
    """Seconds per layout of ``weight``, by ``time_routes``."""
    ops, n = load_cpu_ops(), weight.shape[0]
    packed = {"fma": ops.pack_linear_weight(weight), "pairs": ops.pack_linear_weight_pairs(weight)}
    if amx_applies(weight.shape[1], 32):
        packed["amx"] = ops.pack_linear_weight_amx(weight)
    routes = {name: (lambda x, p=p: ops.fixed_order_linear(x, p, n)) for name, p in packed.items()}
    return time_routes(routes, weight.shape[1], weight.dtype)


def choose(what: str, shape: str, time_candidates) -> str:
    """The cached choice for ``shape`` on this machine, else the fastest of
    ``time_candidates()`` (seconds by name), cached; ``what`` names the weights in the log."""
    key = machine_key()
    if (choice := _read_cache().get(key, {}).get(shape)) is not None:
        return choice
    times = time_candidates()
    # Another process (a tensor-parallel rank) may have chosen meanwhile: its choice stands.
    cache = _read_cache()
    choice = cache.setdefault(key, {}).setdefault(shape, min(times, key=times.get))
    logger.info("%s weights: %s kernel (%s, geometric mean at %s rows; kept in %s)", what, choice,
                ", ".join(f"{name} {t * 1e3:.3f} ms" for name, t in times.items()),
                " and ".join(map(str, _TIMED_ROWS)), _cache_file())
    _write_cache(cache)
    return choice


def amx_applies(k: int, multiple: int) -> bool:
    """Whether AMX tiles run here (``amx_bf16``, ``amx_int8``) on a weight of ``k`` input
    columns, which the tiles take in steps of ``multiple`` (32 bfloat16, 64 int8)."""
    return k % multiple == 0 and load_cpu_ops().amx_tiles_available()


@functools.cache
def bf16_layout(n: int, k: int) -> str:
    """``"amx"``, ``"pairs"`` or ``"fma"``: the layout a bfloat16 weight ``[n, k]`` is packed
    in here (always ``"fma"`` where the pair kernel is not built)."""
    if not load_cpu_ops().pair_linear_available():
        return "fma"
    weight = lambda: torch.randn(min(n, TIMED_COLUMNS), k, dtype=torch.bfloat16)
    return choose(f"bfloat16 [{n}, {k}]", f"{n}x{k}", lambda: _time_layouts(weight()))
