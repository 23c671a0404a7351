"""A picture of the engine between two steps, for the dashboard (``/dashboard/state``).

Take it on the engine thread between steps (``AsyncLLM.run_between_steps``), never inside
one. It reads the scheduler's and KV cache manager's read-only views and costs one pass
over the block tables and the prefix-cache table (numpy for the rest): no tensors, no
per-token data. The block pool travels as two compact arrays, one entry per block::

    state   uint8    0 free, 1 held by one request, 2 shared (ref count > 1),
                     3 cached and free (prefix cache, evictable)
    filled  uint8    K/V slots written, 0..block_size (uint16 if block_size > 255)

A block's holders are the requests whose block table (``requests[i]["blocks"]``) lists it;
its reference count is their number.
"""

from __future__ import annotations

import base64
import functools
import itertools
import operator
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.scheduler import Scheduler
from pagedserve.engine.timeline import LatencyWindow
from pagedserve.metrics import SpecDecodingStats
from pagedserve.request import Request

if TYPE_CHECKING:
    from pagedserve.engine.llm_engine import LLMEngine

FREE, USED, SHARED, CACHED = 0, 1, 2, 3


@dataclass
class PoolState:
    """Per-block arrays of one KV pool (see the module docstring) and the block size."""

    state: np.ndarray  # uint8 [num_blocks]
    filled: np.ndarray  # uint8 [num_blocks], uint16 if block_size > 255
    block_size: int

    def totals(self) -> dict:
        """Block counts per state, tokens stored, and internal fragmentation: the fraction
        of slots in held blocks that hold no token (0-1; 0 when no block is held)."""
        counts = np.bincount(self.state, minlength=4)
        held = self.state == USED
        held |= self.state == SHARED
        num_held = int(held.sum())
        tokens = int(self.filled[held].sum())
        return {
            "total": int(self.state.size),
            "free": int(counts[FREE] + counts[CACHED]),
            "used": num_held,
            "shared": int(counts[SHARED]),
            "cached_free": int(counts[CACHED]),
            "tokens": tokens,
            "fragmentation": 1 - tokens / (num_held * self.block_size) if num_held else 0.0,
        }


def pool_state(kv: KVCacheManager, scheduler: Scheduler,
               tables: dict[str, list[int]]) -> PoolState:
    """The pool's block states and fill levels, from the block tables ``tables``
    (``kv.block_tables()``; a block's fill is its most advanced holder's:
    ``min(block_size, num_computed_tokens - i * block_size)`` for logical block ``i``) and
    the prefix-cache table (cached free blocks are full)."""
    n, bs = kv.pool.num_blocks, kv.block_size
    lengths = np.fromiter((len(t) for t in tables.values()), np.int64, len(tables))
    ids = np.fromiter(itertools.chain.from_iterable(tables.values()), np.int64,
                      int(lengths.sum()))
    holders = np.bincount(ids, minlength=n)
    state = np.where(holders > 1, SHARED, np.where(holders == 1, USED, FREE)).astype(np.uint8)
    computed = np.fromiter((scheduler.get_request(rid).num_computed_tokens for rid in tables),
                           np.int64, len(tables))
    # Logical index of each entry within its own table: 0, 1, 2, 0, 1, 0, ...
    logical = np.arange(ids.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    fill = np.clip(np.repeat(computed, lengths) - logical * bs, 0, bs)
    dtype = np.uint8 if bs <= 255 else np.dtype("<u2")
    filled = np.zeros(n, dtype)
    np.maximum.at(filled, ids, fill.astype(dtype))
    cached = np.asarray(kv.pool.cached_free_block_ids(), np.int64)
    state[cached] = CACHED
    filled[cached] = bs
    return PoolState(state, filled, bs)


def _request_row(r: Request, tables: dict[str, list[int]], now: float) -> dict:
    return {
        "id": r.request_id,
        "lora_name": r.lora_name,
        "status": r.status.name.lower(),
        "prompt_tokens": r.num_prompt_tokens,
        "prompt_computed": min(r.num_computed_tokens, r.num_prompt_tokens),
        "output_tokens": r.num_output_tokens,
        "blocks": tables.get(r.request_id, []),
        "cached_tokens": r.num_cached_tokens,
        "preemptions": r.num_preemptions,
        "age": now - r.arrival_time,
    }


def _b64(array: np.ndarray) -> str:
    return base64.b64encode(array.tobytes()).decode("ascii")


def latency_percentiles(latency: LatencyWindow | None) -> dict:
    """The snapshot's ``latency``: the window (s) and its percentiles; {} without one."""
    return {} if latency is None else {"window": latency.seconds, **latency.percentiles()}


def spec_decoding(stats: SpecDecodingStats | None) -> dict | None:
    """The snapshot's ``spec_decoding``: the cumulative counts and the acceptance rate
    (accepted / verified draft tokens; None before any draft), or None without
    speculative decoding."""
    return None if stats is None else {**asdict(stats), "acceptance_rate": stats.acceptance_rate}


def take_snapshot(engine: LLMEngine, latency: LatencyWindow | None = None) -> dict:
    """The engine's state now, JSON-ready (call between steps, on the engine thread).

    Keys: ``step`` (steps completed), ``time`` (Unix seconds), ``pools`` (one per replica:
    ``num_blocks``, ``block_size``, ``state`` / ``filled`` as base64 of the little-endian
    arrays above, ``filled_dtype`` (``uint8`` or ``uint16``), ``totals``), ``kv_cache_stats`` (``LLMEngine.kv_cache_stats()``, counted
    by the pool itself), ``running`` / ``waiting`` (request rows: ids and counts, no text;
    ``lora_name``: the request's LoRA adapter, None for the base model; ``age`` in
    seconds), ``lora`` (whether the engine serves LoRA adapters), ``steps`` (the step timeline as columns, oldest first; ``ago`` in
    seconds before now, ``duration`` in seconds) and ``latency`` (TTFT / TPOT / end-to-end
    percentiles in seconds over ``latency``'s window; empty without one), ``spec_decoding``
    (``spec_decoding()``) and ``snapshot_seconds`` (the engine thread's time spent taking
    it).
    """
    sched, kv = engine.scheduler, engine.kv_cache_manager
    start = time.perf_counter()
    now = time.monotonic()
    tables = kv.block_tables()
    pool = pool_state(kv, sched, tables)
    steps = engine.timeline.columns()
    # 0.1 ms is plenty for a chart, and short numbers keep the JSON small and quick.
    steps["ago"] = np.round(now - np.asarray(steps.pop("end")), 4).tolist()
    steps["duration"] = np.round(np.asarray(steps["duration"]), 4).tolist()
    snapshot = {
        "step": engine.timeline.num_steps,
        "time": time.time(),
        "pools": [{
            "replica": 0,
            "num_blocks": int(pool.state.size),
            "block_size": pool.block_size,
            "state": _b64(pool.state),
            "filled": _b64(pool.filled),
            "filled_dtype": pool.filled.dtype.name,
            "totals": pool.totals(),
        }],
        "kv_cache_stats": asdict(engine.kv_cache_stats()),
        "running": [_request_row(r, tables, now) for r in sched.running_requests()],
        "waiting": [_request_row(r, tables, now) for r in sched.waiting_requests()],
        "lora": engine.lora_config is not None,
        "steps": steps,
        "latency": latency_percentiles(latency),
        "spec_decoding": spec_decoding(engine.spec_decoding_stats()),
    }
    snapshot["snapshot_seconds"] = time.perf_counter() - start  # what it cost the engine
    return snapshot


def merge_snapshots(snapshots: list[dict]) -> dict:
    """One snapshot of data-parallel replicas (``take_snapshot``'s, in replica order): a
    pool per replica (``replica`` = its index), the request rows of all (each tagged with
    ``replica``), ``kv_cache_stats``, ``step`` and ``spec_decoding`` summed, the step
    timeline of replica 0, the largest ``snapshot_seconds``. One snapshot comes back as it
    is."""
    if len(snapshots) == 1:
        return snapshots[0]
    merged = dict(snapshots[0])
    merged["pools"] = [{**pool, "replica": i} for i, s in enumerate(snapshots)
                       for pool in s["pools"]]
    for key in ("running", "waiting"):
        merged[key] = [{**row, "replica": i} for i, s in enumerate(snapshots) for row in s[key]]
    merged["kv_cache_stats"] = {
        name: (value if name == "block_size"
               else sum(s["kv_cache_stats"][name] for s in snapshots))
        for name, value in snapshots[0]["kv_cache_stats"].items()}
    merged["step"] = sum(s["step"] for s in snapshots)
    specs = [SpecDecodingStats(**{k: v for k, v in s["spec_decoding"].items()
                                  if k != "acceptance_rate"})
             for s in snapshots if s.get("spec_decoding")]
    if specs:
        merged["spec_decoding"] = spec_decoding(functools.reduce(operator.add, specs))
    merged["snapshot_seconds"] = max(s["snapshot_seconds"] for s in snapshots)
    return merged
