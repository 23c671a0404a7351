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

The engine thread's bookkeeping (streams, timings, metrics) is a ``RequestTracker``
(``request_tracker``); the streams and their errors are in ``request_stream``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import torch

from pagedserve.args import EngineArgs
from pagedserve.engine.llm_engine import LLMEngine, PromptType
from pagedserve.engine.request_stream import (
    EngineClosedError,
    EngineStepError,
    RequestAbortedError,
    RequestStream,
)
from pagedserve.engine.request_tracker import (
    AbortCommand,
    AddCommand,
    CallCommand,
    Command,
    RequestTracker,
)
from pagedserve.executor.base import EngineDeadError
from pagedserve.lora.request import LoRARequest
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")


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
        self.num_threads = num_threads or torch.get_num_threads()
        self._cond = threading.Condition()
        self._commands: deque[Command] = deque()
        self._closing = False
        self._shutdown_error: BaseException | None = None
        self._tracker = RequestTracker(engine, stat_logger)  # engine thread only
        self._thread: threading.Thread | None = None
        self.num_steps = 0

    @property
    def stat_logger(self):
        """The stat logger (see the class docstring); set it before ``start()``."""
        return self._tracker.stat_logger

    @stat_logger.setter
    def stat_logger(self, stat_logger) -> None:
        self._tracker.stat_logger = stat_logger

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

    def _submit(self, command: Command) -> None:
        with self._cond:
            if self._closing and not isinstance(command, AbortCommand):
                raise EngineClosedError("the server is shutting down")
            self._commands.append(command)
            self._cond.notify()

    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                          arrival_time: float | None = None,
                          lora_request: LoRARequest | None = None) -> RequestStream:
        """Queue a request; returns its stream once the engine accepted it.

        ``prompt``: text, token ids or ``{"prompt_token_ids": [...]}``. ``arrival_time``:
        ``time.monotonic()`` when the request arrived (default now); latency metrics start
        there. ``lora_request``: its LoRA adapter (None: the base model); one not yet
        registered is loaded by the engine thread, between steps (the server registers its
        adapters beforehand, loading them off that thread). Raises ``ValueError`` (bad
        prompt, parameters or adapter, as ``LLMEngine.add_request``) or
        ``EngineClosedError``; nothing is queued then.

        The command is queued before this coroutine first suspends: commands submitted by
        the same event loop reach the engine in the order their coroutines were started.
        """
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, self)
        future: concurrent.futures.Future = concurrent.futures.Future()
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self._submit(AddCommand(request_id, prompt, params, arrival, stream, loop, future,
                                lora_request))
        try:
            await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self.abort(request_id)  # it may have been added after all; FIFO makes this safe
            raise
        return stream

    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str,
                       arrival_time: float | None = None,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its cumulative outputs until it finishes (vLLM's
        ``AsyncLLM.generate``). Closing the generator early aborts the request. Raises as
        ``add_request`` and ``RequestStream.get``."""
        stream = await self.add_request(request_id, prompt, params, arrival_time, lora_request)
        async for out in stream:
            yield out

    async def run_between_steps(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between two steps (waking an idle
        engine) and return its result: observers (the dashboard's snapshots) and the
        server's adapter registrations (``loras.add`` of an adapter read on another
        thread, ``remove_lora``). ``fn`` must be quick (the next step waits for it) and may
        change the engine only through its public methods. Raises what ``fn`` raises, or
        ``EngineClosedError``."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(CallCommand(fn, future))
        return await asyncio.wrap_future(future)

    async def run_between_steps_all(self, fn: Callable[[LLMEngine], T]) -> list[T]:
        """``[run_between_steps(fn)]``: the interface ``DataParallelLLM`` shares, which
        returns one result per replica."""
        return [await self.run_between_steps(fn)]

    def abort(self, request_id: str) -> None:
        """Abort a request by id (thread-safe; unknown or finished ids are ignored)."""
        with self._cond:
            self._commands.append(AbortCommand(request_id))
            self._cond.notify()

    # -- the engine thread --------------------------------------------------------------

    def _run(self) -> None:
        torch.set_num_threads(self.num_threads)
        logger.debug("engine thread started with %d torch threads", self.num_threads)
        tracker = self._tracker
        while True:
            with self._cond:
                while not (self._commands or self._closing
                           or self.engine.has_unfinished_requests()):
                    self._cond.wait()
                commands = list(self._commands)
                self._commands.clear()
                closing = self._closing
            tracker.apply(commands)
            if closing:
                tracker.drop_all(self._shutdown_error or RequestAbortedError("shut down"))
                tracker.record(None)
                self._fail_pending()
                logger.debug("engine thread stopped")
                return
            if not self.engine.has_unfinished_requests():
                tracker.record(None)
                continue
            try:
                # Gauges also refresh once the step is scheduled: a request in a long
                # prefill step reads as running while it computes, not after.
                outputs = self.engine.step(on_scheduled=tracker.record_scheduled)
            except EngineDeadError as err:  # a rank died or hung: no step can run again
                logger.error("engine is dead, failing %d requests: %s", len(tracker.request_ids),
                             err)
                with self._cond:  # refuse new requests before failing those in flight
                    self._closing = True
                    self._shutdown_error = EngineStepError(f"engine is dead: {err}")
                tracker.drop_all(EngineStepError(f"engine is dead: {err}"))
                tracker.record(None)
                continue
            except Exception as err:  # a bug or device failure: fail what is in flight
                logger.exception("engine step failed; aborting %d requests",
                                 len(tracker.request_ids))
                tracker.drop_all(EngineStepError(f"engine step failed: {err!r}"))
                tracker.record(None)
                continue
            self.num_steps += 1
            tracker.record(tracker.process(outputs))
            if tracker.request_ids and not self.engine.has_unfinished_requests():
                logger.error("requests %s ended without a final output", tracker.request_ids)
                tracker.drop_all(EngineStepError("the request ended without a final output"))

    def _fail_pending(self) -> None:
        """After shutdown: fail adds that raced in (none should; ``_submit`` refuses)."""
        with self._cond:
            leftovers = list(self._commands)
            self._commands.clear()
        for cmd in leftovers:
            if (isinstance(cmd, (AddCommand, CallCommand))
                    and cmd.future.set_running_or_notify_cancel()):
                cmd.future.set_exception(EngineClosedError("the server is shutting down"))


__all__ = ["AsyncLLM"]
