"""Request state: token ids, progress (``num_computed_tokens``) and lifecycle status.

The scheduler schedules *tokens*, not phases: a request always moves
``num_computed_tokens`` toward ``num_tokens``. Prefill, chunked prefill, prefix-cache
hits, decode and recomputation after preemption all follow from that one rule.
"""

from __future__ import annotations

import enum
import time

from pagedserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request. Every status above PREEMPTED is final."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's ``finish_reason`` for a finished status, else None."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One sequence being generated.

    ``all_token_ids`` is the prompt followed by the output so far; tokens
    ``[0, num_computed_tokens)`` have their K/V in the cache. ``spec_token_ids`` are draft
    tokens proposed to follow ``all_token_ids`` (speculative decoding): the next step
    verifies them, and only the accepted ones join ``all_token_ids``. ``grammar`` is the
    sequence's structured-output state (None when unconstrained): made, advanced and read
    by ``structured_output`` (a ``RequestGrammar``), only held here; neither the request
    nor the scheduler looks inside, so this module does not import that one.
    ``lora_id`` is the engine's id of the request's LoRA adapter (0: none), unique per
    load of an adapter: it keys the adapter's slot and its prefix-cache blocks;
    ``lora_name`` is the adapter's name, for observers.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        arrival_time: float | None = None,
        grammar: object | None = None,
        lora_id: int = 0,
        lora_name: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.grammar = grammar
        self.lora_id = lora_id
        self.lora_name = lora_name
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.spec_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def drop_last_tokens(self, num: int) -> None:
        """Forget the last ``num`` output tokens: a stop string ended the request at an
        earlier token of the step (speculative decoding appends several at once)."""
        if num > 0:
            del self.output_token_ids[-num:]
            del self.all_token_ids[-num:]

    def check_stop(self, max_model_len: int) -> bool:
        """Set a finished status if the last token ends the request (token-level rules).

        Stop *strings* are found by the detokenizer, not here.
        """
        params = self.sampling_params
        if self.num_output_tokens < params.min_tokens:
            return False
        last = self.output_token_ids[-1]
        if not params.ignore_eos and last == self.eos_token_id:
            self.status = RequestStatus.FINISHED_STOPPED
        elif last in params.stop_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
            self.stop_reason = last
        elif self.num_output_tokens >= params.max_tokens or self.num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH
        return self.is_finished
