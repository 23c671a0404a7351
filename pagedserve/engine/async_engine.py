"""The async engine: one background thread runs engine steps; asyncio callers stream outputs.

::

    asyncio loop (HTTP)                       engine thread
    -------------------                       -------------
    add_request() --Add--> [command deque] --> apply commands between steps
    stream.abort() --Abort-->    (lock +        engine.step() while there is work,
                                 condition)     else wait on the condition
    RequestStream  <-- loop.call_soon_threadsafe(one batch per step) -- outputs

The engine (``LLMEngine``) is touched only by the engine thread, so it needs no locks.
Requests are added and aborted between steps, and observers (the dashboard's snapshots,
``run_between_steps``) read the engine there too. Each request has a ``RequestStream`` that
keeps only its newest ``RequestOutput`` (outputs are cumulative, so a slow reader skips
intermediate states but never loses text). Neither side blocks the other: the HTTP side
only appends to the command deque; the engine thread only schedules callbacks on the loop.

Errors stay with their request: a ``ValueError`` from ``add_request`` (bad prompt or
parameters) is raised to that caller only. If a step itself fails, the requests in flight
get the error (their blocks are freed) and the loop keeps serving new requests, unless the
engine is dead (``EngineDeadError``: a tensor-parallel rank died or hung): then the loop
stops, new requests are refused and ``is_running`` (the server's ``/health``) is False.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import torch

from pagedserve.executor.multiproc import EngineDeadError
from pagedserve.args import EngineArgs
from pagedserve.engine.llm_engine import LLMEngine, PromptType
from pagedserve.metrics import FinishedRequestStats, IterationStats, SchedulerStats
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")


class EngineClosedError(RuntimeError):
    """The engine is shut down (or shutting down) and takes no new requests."""


class RequestAbortedError(RuntimeError):
    """The engine aborted the request (server shutdown); raised by ``RequestStream.get``."""


class EngineStepError(RuntimeError):
    """An engine step failed while the request was in flight; the request was dropped."""


class RequestStream:
    """Outputs of one request, handed from the engine thread to an asyncio loop.

    Iterate it (``async for out in stream``) to get cumulative ``RequestOutput``s up to and
    including the finished one. ``get()`` raises ``RequestAbortedError`` or
    ``EngineStepError`` if the engine dropped the request. Leaving the iteration early (or
    cancelling the task) aborts the request; so does ``abort()``.
    """

    def __init__(self, request_id: str, engine: AsyncLLM) -> None:
        self.request_id = request_id
        self._engine = engine
        self._latest: RequestOutput | BaseException | None = None
        self._event = asyncio.Event()
        self.finished = False

    def _put(self, item: RequestOutput | BaseException) -> None:
        """Called on the loop thread. An error sticks; an output replaces an older one."""
        if isinstance(self._latest, BaseException):
            return
        self._latest = item
        self._event.set()

    async def get(self) -> RequestOutput:
        """Wait for the newest output (cumulative). Raises what the engine reported."""
        await self._event.wait()
        self._event.clear()
        item, self._latest = self._latest, None
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        """Abort the request unless it already finished (thread-safe, idempotent)."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                yield await self.get()
        finally:
            self.abort()


@dataclass
class _Add:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    arrival_time: float
    stream: RequestStream
    loop: asyncio.AbstractEventLoop
    future: concurrent.futures.Future


@dataclass
class _Abort:
    request_id: str
    error: BaseException | None = None


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    future: concurrent.futures.Future


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


class AsyncLLM:
    """Serve an ``LLMEngine`` to asyncio code from one background thread.

    Args:
        engine: a constructed engine; from now on only the engine thread touches it.
        stat_logger: object with ``record(SchedulerStats | None, IterationStats | None)``
            (``pagedserve.metrics.PrometheusStatLogger``), called on the engine thread when
            a step is scheduled (before the model runs), after every step and every batch
            of adds/aborts; or None.
        num_threads: ``torch.set_num_threads`` for the engine thread (default: the value of
            the constructing thread), so no other thread adds intra-op threads.

    Call ``start()`` before use and ``shutdown()`` at the end.
    """

    def __init__(self, engine: LLMEngine, stat_logger=None, num_threads: int | None = None) -> None:
        self.engine = engine
        self.stat_logger = stat_logger
        self.num_threads = num_threads or torch.get_num_threads()
        self._cond = threading.Condition()
        self._commands: deque[_Add | _Abort | _Call] = deque()
        self._closing = False
        self._shutdown_error: BaseException | None = None
        self._requests: dict[str, _Tracked] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self.num_steps = 0

    @classmethod
    def from_engine_args(cls, args: EngineArgs, stat_logger=None) -> AsyncLLM:
        """Build the engine on a new engine thread and start it there; blocks until it is
        built and raises what ``LLMEngine`` raises.

        Why build it there: libgomp gives every thread that opens an OpenMP region its own
        pool of workers, and once more workers exist than CPUs they stop spinning between
        regions, so each of torch's parallel elementwise ops pays a futex wake-up (F.silu on
        [64, 1728], 2 cores: 70 us on the thread that loaded the model, 140 us on a second
        thread). Loading and stepping on one thread keeps a single pool.

        A ``KeyboardInterrupt`` while the model loads is re-raised once the load has ended
        (exiting while that thread is inside torch's C++ code would abort the process).
        """
        num_threads = torch.get_num_threads()
        built: concurrent.futures.Future[AsyncLLM] = concurrent.futures.Future()

        def build_and_run() -> None:
            if not built.set_running_or_notify_cancel():
                return  # interrupted before the load began
            torch.set_num_threads(num_threads)
            try:
                engine = LLMEngine(args)  # may lower the threads: a rank's share of the cores
                llm = cls(engine, stat_logger, torch.get_num_threads())
            except Exception as err:  # noqa: BLE001 - re-raised by built.result() on the caller
                built.set_exception(err)
                return
            llm._thread = threading.current_thread()
            built.set_result(llm)
            llm._run()  # returns at once if the caller was interrupted (it shuts llm down)

        thread = threading.Thread(target=build_and_run, name="pagedserve-engine", daemon=True)
        try:
            thread.start()  # Ctrl-C may land in here too, once the thread runs
            return built.result()
        except KeyboardInterrupt:
            # The thread either never began the load (cancel succeeds, it returns at once) or
            # has begun it: wait for the load, then stop the engine it built.
            if not built.cancel() and built.exception() is None:
                built.result().shutdown()
            if thread.is_alive():
                thread.join()
            raise

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread (idempotent; ``from_engine_args`` has started it)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pagedserve-engine",
                                            daemon=True)
            self._thread.start()

    @property
    def is_running(self) -> bool:
        """True while the engine thread is alive and accepting requests."""
        return (self._thread is not None and self._thread.is_alive() and not self._closing
                and self.engine.is_healthy())

    def abort_all(self, reason: str = "the server is shutting down") -> None:
        """Stop taking requests and abort every request in flight (thread-safe; callable
        from a signal handler). Streams raise ``RequestAbortedError(reason)``."""
        with self._cond:
            self._closing = True
            self._shutdown_error = RequestAbortedError(reason)
            self._cond.notify()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything in flight, stop the engine thread (waits up to ``timeout`` s)
        and the engine's other ranks."""
        self.abort_all()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():
            self.engine.shutdown()

    # -- requests (any thread with a running asyncio loop) -------------------------------

    def _submit(self, command: _Add | _Abort | _Call) -> None:
        with self._cond:
            if self._closing and not isinstance(command, _Abort):
                raise EngineClosedError("the server is shutting down")
            self._commands.append(command)
            self._cond.notify()

    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                          arrival_time: float | None = None) -> RequestStream:
        """Queue a request; returns its stream once the engine accepted it.

        ``prompt``: text, token ids or ``{"prompt_token_ids": [...]}``. ``arrival_time``:
        ``time.monotonic()`` when the request arrived (default now); latency metrics start
        there. Raises ``ValueError`` (bad prompt or parameters, as ``LLMEngine.add_request``)
        or ``EngineClosedError``; nothing is queued then.
        """
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, self)
        future: concurrent.futures.Future = concurrent.futures.Future()
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self._submit(_Add(request_id, prompt, params, arrival, stream, loop, future))
        try:
            await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self.abort(request_id)  # it may have been added after all; FIFO makes this safe
            raise
        return stream

    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str,
                       arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its cumulative outputs until it finishes (vLLM's
        ``AsyncLLM.generate``). Closing the generator early aborts the request. Raises as
        ``add_request`` and ``RequestStream.get``."""
        stream = await self.add_request(request_id, prompt, params, arrival_time)
        async for out in stream:
            yield out

    async def run_between_steps(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between two steps (waking an idle
        engine) and return its result; for observers such as the dashboard's snapshots.
        ``fn`` must be quick and must not change the engine. Raises what ``fn`` raises, or
        ``EngineClosedError``."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(_Call(fn, future))
        return await asyncio.wrap_future(future)

    async def run_between_steps_all(self, fn: Callable[[LLMEngine], T]) -> list[T]:
        """``[run_between_steps(fn)]``: the interface ``DataParallelLLM`` shares, which
        returns one result per replica."""
        return [await self.run_between_steps(fn)]

    def abort(self, request_id: str) -> None:
        """Abort a request by id (thread-safe; unknown or finished ids are ignored)."""
        with self._cond:
            self._commands.append(_Abort(request_id))
            self._cond.notify()

    # -- the engine thread --------------------------------------------------------------

    def _run(self) -> None:
        torch.set_num_threads(self.num_threads)
        logger.debug("engine thread started with %d torch threads", self.num_threads)
        while True:
            with self._cond:
                while not (self._commands or self._closing
                           or self.engine.has_unfinished_requests()):
                    self._cond.wait()
                commands = list(self._commands)
                self._commands.clear()
                closing = self._closing
            self._apply(commands)
            if closing:
                self._drop_all(self._shutdown_error or RequestAbortedError("shut down"))
                self._record(None)
                self._fail_pending()
                logger.debug("engine thread stopped")
                return
            if not self.engine.has_unfinished_requests():
                self._record(None)
                continue
            try:
                # Gauges also refresh once the step is scheduled: a request in a long
                # prefill step reads as running while it computes, not after.
                outputs = self.engine.step(on_scheduled=self._record_scheduled)
            except EngineDeadError as err:  # a rank died or hung: no step can run again
                logger.error("engine is dead, failing %d requests: %s", len(self._requests), err)
                with self._cond:  # refuse new requests before failing those in flight
                    self._closing = True
                    self._shutdown_error = EngineStepError(f"engine is dead: {err}")
                self._drop_all(EngineStepError(f"engine is dead: {err}"))
                self._record(None)
                continue
            except Exception as err:  # a bug or device failure: fail what is in flight
                logger.exception("engine step failed; aborting %d requests", len(self._requests))
                self._drop_all(EngineStepError(f"engine step failed: {err!r}"))
                self._record(None)
                continue
            self.num_steps += 1
            self._record(self._process(outputs))
            if self._requests and not self.engine.has_unfinished_requests():
                logger.error("requests %s ended without a final output", list(self._requests))
                self._drop_all(EngineStepError("the request ended without a final output"))

    def _apply(self, commands: list[_Add | _Abort | _Call]) -> None:
        for cmd in commands:
            if isinstance(cmd, _Abort):
                self._abort_tracked(cmd.request_id, cmd.error)
            elif isinstance(cmd, _Call):
                if cmd.future.set_running_or_notify_cancel():
                    try:
                        cmd.future.set_result(cmd.fn(self.engine))
                    except Exception as err:  # noqa: BLE001 - the caller gets it
                        cmd.future.set_exception(err)
            elif cmd.future.set_running_or_notify_cancel():
                try:
                    self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params,
                                            cmd.arrival_time)
                except Exception as err:  # ValueError: bad input; anything else: a bug
                    if not isinstance(err, ValueError):
                        logger.exception("add_request(%r) failed", cmd.request_id)
                        self._safe_abort(cmd.request_id)
                    cmd.future.set_exception(err)
                    continue
                self._requests[cmd.request_id] = _Tracked(cmd.stream, cmd.loop,
                                                          cmd.arrival_time, cmd.params)
                cmd.future.set_result(None)

    def _fail_pending(self) -> None:
        """After shutdown: fail adds that raced in (none should; ``_submit`` refuses)."""
        with self._cond:
            leftovers = list(self._commands)
            self._commands.clear()
        for cmd in leftovers:
            if isinstance(cmd, (_Add, _Call)) and cmd.future.set_running_or_notify_cancel():
                cmd.future.set_exception(EngineClosedError("the server is shutting down"))

    def _safe_abort(self, request_id: str) -> None:
        try:
            self.engine.abort_request(request_id)
        except Exception:  # pragma: no cover - keep the loop alive
            logger.exception("abort_request(%r) failed", request_id)

    def _abort_tracked(self, request_id: str, error: BaseException | None,
                       stats: IterationStats | None = None) -> None:
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

    def _drop_all(self, error: BaseException) -> None:
        stats = IterationStats()
        for rid in list(self._requests):
            self._abort_tracked(rid, error, stats)
        if self.stat_logger is not None and stats.finished_requests:
            self.stat_logger.record(None, stats)

    def _process(self, outputs: list[RequestOutput]) -> IterationStats:
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
                self._abort_tracked(out.request_id, EngineStepError(repr(err)), stats)
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

    def _record_scheduled(self) -> None:
        self._record(None)

    def _record(self, stats: IterationStats | None) -> None:
        if self.stat_logger is None:
            return
        try:
            kv = self.engine.kv_cache_stats()
            sched = self.engine.scheduler
            self.stat_logger.record(SchedulerStats(
                num_running_reqs=sched.num_running,
                num_waiting_reqs=sched.num_waiting,
                kv_cache_usage=kv.usage,
                prefix_cache_queries=kv.prefix_cache_queries,
                prefix_cache_hits=kv.prefix_cache_hits,
                num_preemptions=sched.num_preemptions,
            ), stats)
        except Exception:  # pragma: no cover - metrics never take the engine down
            logger.exception("recording metrics failed")


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


__all__ = [
    "AsyncLLM",
    "EngineClosedError",
    "EngineStepError",
    "RequestAbortedError",
    "RequestStream",
]
