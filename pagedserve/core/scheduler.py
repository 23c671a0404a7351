"""Continuous batching: every step, choose which requests run and how many tokens each.

The scheduler holds no tensors. Each step it walks the running requests first (their
decode token, or the next chunk of a prompt) and then admits waiting requests, within
``max_num_batched_tokens`` tokens and ``max_num_seqs`` sequences. When the pool has no
block for a running request, the latest-arrived running request is preempted: its
blocks are freed and it goes back to the front of the queue to be recomputed later.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from dataclasses import dataclass, field

from pagedserve.config import SchedulerConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    """What one step computes.

    ``requests[i]`` computes ``num_scheduled_tokens[i]`` tokens starting at its
    ``num_computed_tokens``; ``block_tables[i]`` is its block table for this step.
    """

    requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.requests


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # kept in arrival order: preempt from the tail
        self.requests: dict[str, Request] = {}
        self._arrival_seq = itertools.count()
        self._arrival: dict[str, int] = {}
        self.num_preemptions = 0

    # -- queue --------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self._arrival[request.request_id] = next(self._arrival_seq)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids, status: RequestStatus) -> list[Request]:
        """Finish (stop string, abort) the given requests; unknown ids are ignored."""
        finished = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._release(request)
            finished.append(request)
        return finished

    def _release(self, request: Request) -> None:
        self.kv.free(request)
        del self.requests[request.request_id]
        del self._arrival[request.request_id]

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- one step -----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while self.kv.allocate_slots(request, num_new) is None:
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_request_ids.append(victim.request_id)
                if victim is request:
                    break
            else:
                scheduled.append((request, num_new))
                budget -= num_new
                i += 1

        # New requests wait while running ones are being preempted for lack of blocks.
        while (
            self.waiting
            and not out.preempted_request_ids
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            computed_blocks, num_cached = self.kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_cached
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            if self.kv.allocate_slots(request, num_new, computed_blocks) is None:
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached
            self._insert_running(request)
            scheduled.append((request, num_new))
            budget -= num_new

        for request, num_new in scheduled:
            out.requests.append(request)
            out.num_scheduled_tokens.append(num_new)
            out.block_tables.append(self.kv.block_ids(request.request_id))
        return out

    def _insert_running(self, request: Request) -> None:
        keys = [self._arrival[r.request_id] for r in self.running]
        pos = bisect.bisect(keys, self._arrival[request.request_id])
        self.running.insert(pos, request)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # -- after the forward pass ---------------------------------------------------------

    def update_from_output(
        self, out: SchedulerOutput, sampled: dict[str, int]
    ) -> list[Request]:
        """Advance each scheduled request, append its sampled token, apply token-level stops.

        Returns the requests that finished in this step (their blocks are already free).
        """
        finished = []
        for request, num_new in zip(out.requests, out.num_scheduled_tokens):
            request.num_computed_tokens += num_new
            token = sampled.get(request.request_id)
            if token is None:
                continue  # a prompt chunk that did not reach the end of the prompt
            request.append_output_token(token)
            if request.check_stop(self.config.max_model_len):
                self.running.remove(request)
                self._release(request)
                finished.append(request)
        return finished
