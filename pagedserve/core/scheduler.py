"""Continuous batching: every step, choose which requests run and how many tokens each.

The scheduler holds no tensors. Each step it walks the running requests first (their
decode token, or the next chunk of a prompt) and then admits waiting requests, within
``max_num_batched_tokens`` tokens and ``max_num_seqs`` sequences (with
``scheduling="static"``, only while the current batch is still forming). When the pool
has no block for a running request, the latest-arrived running request is preempted: its
blocks are freed and it goes back to the front of the queue to be recomputed later.

Speculative decoding changes only how many tokens a running request computes: its last
token plus its draft tokens (``spec_token_ids``, proposed at the end of the previous step),
which the step verifies; the rejected drafts' slots are given back afterwards. In a step
that speculates (``speculate``), each request that samples also gets the slots a draft
model writes ahead (``SpeculativeConfig.num_lookahead_tokens``).

LoRA: a step may use at most ``max_loras`` adapters (``Request.lora_id``). Admission stays
first come, first served across adapters: when the oldest waiting request's adapter would
be one too many, nobody behind it is admitted until a slot frees (vLLM skips such a
request, which can starve it).
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from dataclasses import dataclass, field

from pagedserve.config import SchedulerConfig, SpeculativeConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    """What one step computes.

    ``requests[i]`` computes ``num_scheduled_tokens[i]`` tokens starting at its
    ``num_computed_tokens``; ``block_tables[i]`` is its block table for this step. A
    request in ``spec_token_ids`` computes its last token followed by those draft tokens
    (verification). ``speculate``: the requests that sample in this step get draft tokens
    for the next one.
    """

    requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    # Copy-on-write: copy block src to block dst (all layers) before the forward pass.
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # Samples 1..n-1 of a request: they sample from its logits when its prompt completes
    # in this step, then fork its blocks.
    forks: dict[str, list[Request]] = field(default_factory=dict)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    speculate: bool = False

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.requests


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 spec_config: SpeculativeConfig | None = None,
                 max_loras: int | None = None) -> None:
        self.config = config
        self.max_loras = max_loras
        self.kv = kv_cache_manager
        self.spec_config = spec_config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # kept in arrival order: preempt from the tail
        self.requests: dict[str, Request] = {}
        self._arrival_seq = itertools.count()
        self._arrival: dict[str, int] = {}
        # request id -> its sibling samples waiting for the end of its prompt to fork
        self.pending_forks: dict[str, list[Request]] = {}
        self.num_preemptions = 0
        # Static scheduling: whether the current batch may still take new requests.
        self._batch_open = True

    # -- queue --------------------------------------------------------------------------

    def add_request(self, request: Request, forks: list[Request] = ()) -> None:
        """Queue ``request``; ``forks`` are further samples of the same prompt that share
        its prompt blocks: they join when its prompt has been computed."""
        if 1 + len(forks) > self.config.max_num_seqs:
            raise ValueError(
                f"n={1 + len(forks)} samples exceed max_num_seqs={self.config.max_num_seqs}")
        for r in (request, *forks):
            self._arrival[r.request_id] = next(self._arrival_seq)
            self.requests[r.request_id] = r
        if forks:
            self.pending_forks[request.request_id] = list(forks)
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
            elif request in self.waiting:
                self.waiting.remove(request)
            else:
                self._drop_pending_fork(request)
            request.status = status
            self._release(request)
            self._promote_forks(request)
            finished.append(request)
        return finished

    def _promote_forks(self, parent: Request) -> None:
        """A parent finished before its prompt completed: its first waiting fork takes its
        place at the head of the queue (and inherits the other forks)."""
        forks = self.pending_forks.pop(parent.request_id, [])
        if forks:
            heir, rest = forks[0], forks[1:]
            if rest:
                self.pending_forks[heir.request_id] = rest
            self.waiting.appendleft(heir)

    def _drop_pending_fork(self, request: Request) -> None:
        for parent_id, forks in self.pending_forks.items():
            if request in forks:
                forks.remove(request)
                if not forks:
                    del self.pending_forks[parent_id]
                return

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

    def running_requests(self) -> tuple[Request, ...]:
        """The running requests in arrival order (a copy of the queue, for observers)."""
        return tuple(self.running)

    def waiting_requests(self) -> tuple[Request, ...]:
        """The waiting (and preempted) requests, next to be admitted first (a copy)."""
        return tuple(self.waiting)

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or None."""
        return self.requests.get(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- one step -----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(speculate=self._speculate())
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens + len(request.spec_token_ids)
                          - request.num_computed_tokens, budget)
            lookahead = self._lookahead(request, num_new, out.speculate)
            while self.kv.allocate_slots(request, num_new, (), lookahead) is None:
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_request_ids.append(victim.request_id)
                if victim is request:
                    break
            else:
                scheduled.append((request, num_new))
                budget -= num_new
                i += 1

        # Static scheduling (a baseline): a batch forms when nothing runs, taking requests
        # over as many steps as its prompts need of the token budget; once admission stops
        # for any other reason (max_num_seqs, blocks, empty queue) it is closed, and nobody
        # joins until its last request has finished.
        static = self.config.scheduling == "static"
        if static and not self.running:
            self._batch_open = True
        adapters = {r.lora_id for r in self.running if r.lora_id}
        # New requests wait while running ones are being preempted for lack of blocks.
        while (
            self.waiting
            and not out.preempted_request_ids
            and budget > 0
            and (self._batch_open or not static)
        ):
            request = self.waiting[0]
            num_seqs = 1 + len(self.pending_forks.get(request.request_id, ()))
            if self._num_seats_taken() + num_seqs > self.config.max_num_seqs:
                break
            if not self._lora_fits(request, adapters):
                break
            computed_blocks, num_cached = self.kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_cached
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            lookahead = self._lookahead(request, num_new + num_cached, out.speculate)
            if self.kv.allocate_slots(request, num_new, computed_blocks, lookahead) is None:
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached
            self._insert_running(request)
            if request.lora_id:
                adapters.add(request.lora_id)
            scheduled.append((request, num_new))
            budget -= num_new
        if static and self.running and budget > 0:
            self._batch_open = False

        for request, num_new in scheduled:
            out.requests.append(request)
            out.num_scheduled_tokens.append(num_new)
            out.block_tables.append(self.kv.block_ids(request.request_id))
            num_spec = request.num_computed_tokens + num_new - request.num_tokens
            if num_spec > 0:  # the budget may cut a request's drafts short
                out.spec_token_ids[request.request_id] = request.spec_token_ids[:num_spec]
            forks = self.pending_forks.get(request.request_id)
            if forks and request.num_computed_tokens + num_new == request.num_tokens:
                out.forks[request.request_id] = list(forks)
        out.blocks_to_copy = self.kv.take_pending_copies()
        return out

    def _speculate(self) -> bool:
        """Whether this step's sampled requests get drafts: speculation is on and the batch
        runs fewer than ``disable_by_batch_size`` requests."""
        spec = self.spec_config
        return spec is not None and (spec.disable_by_batch_size is None
                                     or len(self.running) < spec.disable_by_batch_size)

    def _lookahead(self, request: Request, num_new: int, speculate: bool) -> int:
        """Slots a draft model writes after the ``num_new`` tokens the request computes
        (counted from its ``num_computed_tokens``): only if it samples in this step, and
        never past ``max_model_len`` (no draft goes there), so that a sequence of
        ``max_model_len`` tokens fits any pool that fits it without speculation."""
        end = request.num_computed_tokens + num_new
        if not speculate or end < request.num_tokens:
            return 0
        return max(0, min(self.spec_config.num_lookahead_tokens,
                          self.config.max_model_len - end))

    def _lora_fits(self, request: Request, adapters: set[int]) -> bool:
        """Whether ``request`` may join a step whose running requests use ``adapters``."""
        return (not request.lora_id or self.max_loras is None or request.lora_id in adapters
                or len(adapters) < self.max_loras)

    def _num_seats_taken(self) -> int:
        """Running sequences plus the forks they will spawn when their prompt completes."""
        pending = sum(len(forks) for rid, forks in self.pending_forks.items()
                      if self.requests[rid].status == RequestStatus.RUNNING)
        return len(self.running) + pending

    def _insert_running(self, request: Request) -> None:
        keys = [self._arrival[r.request_id] for r in self.running]
        pos = bisect.bisect(keys, self._arrival[request.request_id])
        self.running.insert(pos, request)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # -- after the forward pass ---------------------------------------------------------

    def update_from_output(
        self, out: SchedulerOutput, sampled: dict[str, list[int]],
        drafts: dict[str, list[int]] | None = None,
    ) -> list[Request]:
        """Advance each scheduled request, append its new tokens, apply token-level stops.

        ``sampled[id]`` holds a request's new tokens: its accepted draft tokens, then one
        sampled token. A token-level stop drops the tokens after it (the list is cut to
        those appended). ``drafts[id]`` are a request's draft tokens for the next step.
        Returns the requests that finished in this step (their blocks are already free).
        """
        finished = []
        for request, num_new in zip(out.requests, out.num_scheduled_tokens):
            tokens = sampled.get(request.request_id)
            if tokens is None:  # a prompt chunk that did not reach the end of the prompt
                request.num_computed_tokens += num_new
                continue
            num_rejected = len(out.spec_token_ids.get(request.request_id, ())) + 1 - len(tokens)
            request.num_computed_tokens += num_new - num_rejected
            forks = out.forks.get(request.request_id, [])
            for child in forks:  # before the parent may finish and free its blocks
                self._join_fork(request, child)
            self.pending_forks.pop(request.request_id, None)
            for r in (request, *forks):
                r.spec_token_ids = []
                if self._append_tokens(r, sampled[r.request_id]):
                    self.running.remove(r)
                    self._release(r)
                    finished.append(r)
                else:
                    self.kv.free_excess(r)
                    r.spec_token_ids = (drafts or {}).get(r.request_id, [])
        return finished

    def _append_tokens(self, request: Request, tokens: list[int]) -> bool:
        """Append ``tokens`` until one stops the request (True); those after it are dropped
        from ``tokens`` too."""
        for i, token in enumerate(tokens):
            request.append_output_token(token)
            if request.check_stop(self.config.max_model_len):
                del tokens[i + 1:]
                return True
        return False

    def _join_fork(self, parent: Request, child: Request) -> None:
        self.kv.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = RequestStatus.RUNNING
        self._insert_running(child)
