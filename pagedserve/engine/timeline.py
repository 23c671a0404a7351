"""What the engine did recently: one record per step, and latencies over a sliding window.

Both feed the dashboard (``/dashboard``) and ``pagedserve bench throughput --timeline``.
Recording a step costs one pass over the step's requests (no tensors, no per-token data).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from pagedserve.core.scheduler import Scheduler, SchedulerOutput
from pagedserve.metrics import IterationStats, SchedulerStats


class StepRecord(NamedTuple):
    """One engine step.

    ``prefill_tokens`` counts prompt tokens and tokens recomputed after a preemption;
    ``decode_tokens`` the one-token steps of requests that already have output. ``end`` is
    ``time.monotonic()`` when the step ended; ``duration`` is in seconds (schedule + forward
    + output processing). ``used_blocks`` and the queue lengths are read after the step.
    """

    step: int
    end: float
    duration: float
    prefill_tokens: int
    decode_tokens: int
    num_rows: int
    num_preempted: int
    used_blocks: int
    num_running: int
    num_waiting: int


@dataclass(slots=True)
class StepStart:
    """What a step scheduled, counted before its requests advance (``StepTimeline.begin``)."""

    start: float
    prefill_tokens: int
    decode_tokens: int
    num_rows: int
    num_preempted: int


class StepTimeline:
    """The last ``maxlen`` steps (all steps when ``maxlen`` is None).

    ``num_steps`` counts every step recorded, also those that have left the window.
    """

    def __init__(self, maxlen: int | None = 300) -> None:
        if maxlen is not None and maxlen < 1:
            raise ValueError(f"maxlen must be >= 1 or None; got {maxlen}")
        self.records: deque[StepRecord] = deque(maxlen=maxlen)
        self.num_steps = 0

    @staticmethod
    def begin(sched: SchedulerOutput, start: float) -> StepStart:
        """Count the scheduled tokens of ``sched`` (call before the requests advance);
        ``start`` is ``time.monotonic()`` before ``schedule()`` ran."""
        decode = 0
        for request, num_new in zip(sched.requests, sched.num_scheduled_tokens):
            if (num_new == 1 and request.num_output_tokens > 0
                    and request.num_computed_tokens == request.num_tokens - 1):
                decode += 1
        return StepStart(start, sched.total_num_scheduled_tokens - decode, decode,
                         len(sched.requests), len(sched.preempted_request_ids))

    def end(self, started: StepStart, scheduler: Scheduler) -> None:
        """Record the step begun with ``started``, reading the queues and pool after it."""
        now = time.monotonic()
        self.num_steps += 1
        pool = scheduler.kv.pool
        self.records.append(StepRecord(
            self.num_steps, now, now - started.start, started.prefill_tokens,
            started.decode_tokens, started.num_rows, started.num_preempted,
            pool.num_blocks - pool.num_free_blocks, scheduler.num_running,
            scheduler.num_waiting))

    def columns(self) -> dict[str, list]:
        """The records as columns (``step``, ``end``, ``duration``, ... as in
        ``StepRecord``), oldest first: what charts take."""
        columns = zip(*self.records) if self.records else ([] for _ in StepRecord._fields)
        return {name: list(col) for name, col in zip(StepRecord._fields, columns)}


class LatencyWindow:
    """TTFT, TPOT and end-to-end latencies of the last ``seconds`` seconds.

    A stat logger (``record(SchedulerStats | None, IterationStats | None)``, called on the
    engine thread): it sees the same measurements as the Prometheus histograms of
    ``/metrics`` (``time_to_first_token``, ``inter_token_latency`` as TPOT,
    ``e2e_request_latency``), and keeps them with their time to slide the window.
    """

    NAMES = ("ttft", "tpot", "e2e")

    def __init__(self, seconds: float = 60.0, clock=time.monotonic) -> None:
        if seconds <= 0:
            raise ValueError(f"seconds must be > 0; got {seconds}")
        self.seconds = seconds
        self.clock = clock
        self._values: dict[str, deque[tuple[float, float]]] = {n: deque() for n in self.NAMES}

    def record(self, scheduler_stats: SchedulerStats | None,
               iteration_stats: IterationStats | None, engine_idx: int = 0) -> None:
        """Add a step's latencies; ``engine_idx`` (a data-parallel replica) is ignored:
        one window covers every replica."""
        if iteration_stats is None:
            return
        now = self.clock()
        it = iteration_stats
        self._values["ttft"].extend((now, v) for v in it.time_to_first_tokens)
        self._values["tpot"].extend((now, v) for v in it.inter_token_latencies)
        self._values["e2e"].extend((now, f.e2e_latency) for f in it.finished_requests)
        self._prune(now)

    def _prune(self, now: float) -> None:
        oldest = now - self.seconds
        for values in self._values.values():
            while values and values[0][0] < oldest:
                values.popleft()

    def percentiles(self, qs: tuple[int, ...] = (50, 90, 99)) -> dict[str, dict]:
        """``{"ttft": {"count": n, "p50": s, "p90": s, "p99": s}, "tpot": ..., "e2e": ...}``
        over the window, in seconds (None when the window holds no value)."""
        self._prune(self.clock())
        out = {}
        for name, values in self._values.items():
            points = ([None] * len(qs) if not values
                      else np.percentile([v for _, v in values], qs).tolist())
            out[name] = {"count": len(values), **{f"p{q}": p for q, p in zip(qs, points)}}
        return out


class StatLoggers:
    """Hands each ``record`` call to several stat loggers, in order."""

    def __init__(self, *loggers) -> None:
        self.loggers = loggers

    def record(self, scheduler_stats: SchedulerStats | None,
               iteration_stats: IterationStats | None, engine_idx: int = 0) -> None:
        for logger in self.loggers:
            logger.record(scheduler_stats, iteration_stats, engine_idx=engine_idx)
