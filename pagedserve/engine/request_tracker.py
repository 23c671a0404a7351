"""The engine thread's bookkeeping of the requests ``AsyncLLM`` serves: the commands it
applies between steps, each request's stream and timings, the metrics of every step, and
handing each step's outputs to the streams' asyncio loops (one callback per loop).

Only the engine thread calls a ``RequestTracker``, so it needs no locks; it touches the
engine between steps only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from pagedserve.engine.llm_engine import LLMEngine, PromptType
from pagedserve.engine.request_stream import EngineStepError, RequestStream
from pagedserve.lora.request import LoRARequest
from pagedserve.metrics import FinishedRequestStats, IterationStats, SchedulerStats
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class AddCommand:
    """Add a request (with ``lora_request``'s adapter if given); ``future`` gets None once
    the engine took it, else its error."""

    request_id: str
    prompt: PromptType
    params: SamplingParams
    arrival_time: float
    stream: RequestStream
    loop: asyncio.AbstractEventLoop
    future: concurrent.futures.Future
    lora_request: LoRARequest | None = None


@dataclass
class AbortCommand:
    """Abort a request; its stream raises ``error`` unless that is None."""

    request_id: str
    error: BaseException | None = None


@dataclass
class CallCommand:
    """Run ``fn(engine)`` between two steps; ``future`` gets its result or error."""

    fn: Callable[[LLMEngine], Any]
    future: concurrent.futures.Future


Command = AddCommand | AbortCommand | CallCommand


@dataclass
class _Tracked:
    """Engine-thread bookkeeping of one request (for streams and metrics)."""

    stream: RequestStream
    loop: asyncio.AbstractEventLoop
    arrival_time: float
    params: SamplingParams
    num_prompt_tokens: int = 0
    num_tokens: list[int] = field(default_factory=list)  # per sample, last seen
    last_token_time: float | None = None
    first_token_time: float | None = None
    first_scheduled_time: float | None = None
    last_output: RequestOutput | None = None


class RequestTracker:
    """The requests in flight, seen from the engine thread.

    Args:
        engine: the engine; only the engine thread touches it.
        stat_logger: as ``AsyncLLM``'s: ``record(SchedulerStats | None, IterationStats |
            None)``, called after every step and every batch of adds/aborts; or None.
    """

    def __init__(self, engine: LLMEngine, stat_logger=None) -> None:
        self.engine = engine
        self.stat_logger = stat_logger
        self._requests: dict[str, _Tracked] = {}

    @property
    def request_ids(self) -> list[str]:
        """The ids of the requests in flight."""
        return list(self._requests)

    def apply(self, commands: list[Command]) -> None:
        """Apply add, abort and call commands in their order (between two steps)."""
        for cmd in commands:
            if isinstance(cmd, AbortCommand):
                self.abort(cmd.request_id, cmd.error)
            elif isinstance(cmd, CallCommand):
                if cmd.future.set_running_or_notify_cancel():
                    try:
                        cmd.future.set_result(cmd.fn(self.engine))
                    except Exception as err:  # noqa: BLE001 - the caller gets it
                        cmd.future.set_exception(err)
            elif cmd.future.set_running_or_notify_cancel():
                try:
                    self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params,
                                            cmd.arrival_time, lora_request=cmd.lora_request)
                except Exception as err:  # ValueError: bad input; anything else: a bug
                    if not isinstance(err, ValueError):
                        logger.exception("add_request(%r) failed", cmd.request_id)
                        self._safe_abort(cmd.request_id)
                    cmd.future.set_exception(err)
                    continue
                self._requests[cmd.request_id] = _Tracked(cmd.stream, cmd.loop,
                                                          cmd.arrival_time, cmd.params)
                cmd.future.set_result(None)

    def _safe_abort(self, request_id: str) -> None:
        try:
            self.engine.abort_request(request_id)
        except Exception:  # pragma: no cover - keep the loop alive
            logger.exception("abort_request(%r) failed", request_id)

    def abort(self, request_id: str, error: BaseException | None,
              stats: IterationStats | None = None) -> None:
        """Abort a request in flight (others are ignored); its stream raises ``error``
        unless that is None. Its finished-request stats go to ``stats`` if given (a batch
        of aborts), else to the stat logger at once."""
        tracked = self._requests.pop(request_id, None)
        if tracked is None:
            return
        self._safe_abort(request_id)
        logger.info("aborted request %s%s", request_id, f" ({error})" if error else "")
        if error is not None:
            _deliver(tracked.loop, [(tracked.stream, error)])
        finished = self._finished_stats(tracked, "abort", time.monotonic())
        if stats is not None:
            stats.finished_requests.append(finished)
        elif self.stat_logger is not None:
            self.stat_logger.record(None, IterationStats(finished_requests=[finished]))

    def drop_all(self, error: BaseException) -> None:
        """Abort every request in flight; their streams raise ``error``."""
        stats = IterationStats()
        for rid in list(self._requests):
            self.abort(rid, error, stats)
        if self.stat_logger is not None and stats.finished_requests:
            self.stat_logger.record(None, stats)

    def process(self, outputs: list[RequestOutput]) -> IterationStats:
        """Update per-request bookkeeping, compute the step's stats, deliver outputs."""
        now = time.monotonic()
        stats = IterationStats()
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            tracked = self._requests.get(out.request_id)
            if tracked is None:
                continue
            try:
                snapshot = self._observe(tracked, out, now, stats)
            except Exception as err:  # pragma: no cover - a bug: fail this request only
                logger.exception("processing output of %r failed", out.request_id)
                self.abort(out.request_id, EngineStepError(repr(err)), stats)
                continue
            batches.setdefault(tracked.loop, []).append((tracked.stream, snapshot))
            if out.finished:
                del self._requests[out.request_id]
        for loop, items in batches.items():
            _deliver(loop, items)
        return stats

    def _observe(self, tracked: _Tracked, out: RequestOutput, now: float,
                 stats: IterationStats) -> RequestOutput:
        if not tracked.num_tokens:
            tracked.num_tokens = [0] * len(out.outputs)
            tracked.num_prompt_tokens = len(out.prompt_token_ids)
        if out.metrics is not None and tracked.first_scheduled_time is None:
            tracked.first_scheduled_time = out.metrics.first_scheduled_time
        new_tokens = 0
        for c in out.outputs:
            grown = len(c.token_ids) - tracked.num_tokens[c.index]
            if grown > 0:
                stats.num_seqs += 1
                new_tokens += grown
                tracked.num_tokens[c.index] = len(c.token_ids)
        if new_tokens:
            stats.num_generation_tokens += new_tokens
            if tracked.first_token_time is None:
                tracked.first_token_time = now
                stats.num_prompt_tokens += tracked.num_prompt_tokens
                stats.time_to_first_tokens.append(now - tracked.arrival_time)
            else:
                stats.inter_token_latencies.append(now - tracked.last_token_time)
            tracked.last_token_time = now
        snapshot = _snapshot(out)
        tracked.last_output = snapshot
        if out.finished:
            reason = next((c.finish_reason for c in out.outputs if c.finish_reason), "stop")
            stats.finished_requests.append(self._finished_stats(tracked, reason, now))
        return snapshot

    @staticmethod
    def _finished_stats(tracked: _Tracked, reason: str, now: float) -> FinishedRequestStats:
        arrival = tracked.arrival_time
        scheduled = tracked.first_scheduled_time or now
        first = tracked.first_token_time or now
        last = tracked.last_token_time or now
        return FinishedRequestStats(
            finish_reason=reason,
            e2e_latency=now - arrival,
            num_prompt_tokens=tracked.num_prompt_tokens,
            num_generation_tokens=sum(tracked.num_tokens),
            max_tokens_param=tracked.params.max_tokens,
            n_param=tracked.params.n,
            queued_time=max(0.0, scheduled - arrival),
            prefill_time=max(0.0, first - scheduled),
            inference_time=max(0.0, last - scheduled),
            decode_time=max(0.0, last - first),
        )

    def record_scheduled(self) -> None:
        """``LLMEngine.step``'s ``on_scheduled``: gauges refresh once a step is scheduled."""
        self.record(None)

    def record(self, stats: IterationStats | None) -> None:
        """Report the scheduler's gauges and ``stats`` (a step's, or None) to the stat logger."""
        if self.stat_logger is None:
            return
        try:
            kv = self.engine.kv_cache_stats()
            sched = self.engine.scheduler
            running = waiting = None
            if self.engine.lora_config is not None:
                running = _count_adapters(sched.running_requests())
                waiting = _count_adapters(sched.waiting_requests())
            self.stat_logger.record(SchedulerStats(
                num_running_reqs=sched.num_running,
                num_waiting_reqs=sched.num_waiting,
                kv_cache_usage=kv.usage,
                prefix_cache_queries=kv.prefix_cache_queries,
                prefix_cache_hits=kv.prefix_cache_hits,
                num_preemptions=sched.num_preemptions,
                spec_decoding=self.engine.spec_decoding_stats(),
                running_lora_adapters=running,
                waiting_lora_adapters=waiting,
            ), stats)
        except Exception:  # pragma: no cover - metrics never take the engine down
            logger.exception("recording metrics failed")


def _count_adapters(requests) -> dict[str, int]:
    """LoRA adapter name -> how many of ``requests`` (scheduler ``Request``s) use it."""
    counts: dict[str, int] = {}
    for r in requests:
        if r.lora_name is not None:
            counts[r.lora_name] = counts.get(r.lora_name, 0) + 1
    return counts


def _snapshot(out: RequestOutput) -> RequestOutput:
    """Copy the lists the engine keeps appending to, so the loop thread reads a fixed state."""
    outputs = [replace(c, logprobs=None if c.logprobs is None else list(c.logprobs))
               for c in out.outputs]
    prompt_logprobs = None if out.prompt_logprobs is None else list(out.prompt_logprobs)
    return replace(out, outputs=outputs, prompt_logprobs=prompt_logprobs, metrics=None)


def _deliver(loop: asyncio.AbstractEventLoop, items: list) -> None:
    """Hand ``(stream, output or error)`` pairs to ``loop`` with one thread-safe callback."""

    def put_all() -> None:
        for stream, item in items:
            stream._put(item)

    try:
        loop.call_soon_threadsafe(put_all)
    except RuntimeError:  # the loop is closed: nobody is listening any more
        pass

