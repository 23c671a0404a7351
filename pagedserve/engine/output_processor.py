"""Turns sampled tokens into ``RequestOutput``s: detokenization, stop strings, logprobs,
and gathering the ``n`` samples of one request back together."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagedserve.detokenizer import IncrementalDetokenizer
from pagedserve.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
)
from pagedserve.request import Request, RequestStatus
from pagedserve.sampling_params import SamplingParams
from pagedserve.worker.model_runner import ModelRunnerOutput, TokenLogprobs


@dataclass
class SampleState:
    """Output-side state of one sequence (one of a request's ``n`` samples)."""

    index: int
    request: Request
    detokenizer: IncrementalDetokenizer | None
    logprobs: SampleLogprobs | None
    cumulative_logprob: float | None


@dataclass
class ParentState:
    """A user request: prompt, parameters, and its samples."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    samples: list[SampleState] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None

    @property
    def finished(self) -> bool:
        return all(s.request.is_finished for s in self.samples)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        self.sample_to_parent: dict[str, ParentState] = {}

    def add_request(self, parent: ParentState, children: list[Request]) -> None:
        self.parents[parent.request_id] = parent
        params = parent.params
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None] * len(parent.prompt_token_ids)
        for index, child in enumerate(children):
            detok = None
            if self.tokenizer is not None and child.sampling_params.detokenize:
                detok = IncrementalDetokenizer(self.tokenizer, child.prompt_token_ids,
                                               child.sampling_params)
            logprobs = [] if params.logprobs is not None else None
            cumulative = 0.0 if params.logprobs is not None else None
            parent.samples.append(SampleState(index, child, detok, logprobs, cumulative))
            self.sample_to_parent[child.request_id] = parent

    def mark_scheduled(self, requests: list[Request]) -> None:
        """Stamp the requests' first scheduling time (the end of their queue time)."""
        now = time.monotonic()
        for request in requests:
            parent = self.sample_to_parent.get(request.request_id)
            if parent is not None and parent.metrics.first_scheduled_time is None:
                parent.metrics.first_scheduled_time = now

    def process(self, requests: list[Request], out: ModelRunnerOutput
                ) -> tuple[list[ParentState], list[Request]]:
        """Update the samples that produced a token this step.

        Returns the touched requests, and the samples a stop string ended: the caller
        finishes those in the scheduler, then makes the outputs (``make_output``).
        """
        now = time.monotonic()
        touched: dict[str, ParentState] = {}
        stopped: list[Request] = []
        for request in requests:
            parent = self.sample_to_parent.get(request.request_id)
            if parent is None:
                continue
            if request.request_id in out.prompt_logprobs:
                self._add_prompt_logprobs(parent, *out.prompt_logprobs[request.request_id])
            tokens = out.sampled.get(request.request_id)
            if tokens is None:
                continue
            sample = parent.samples[self._index(parent, request)]
            if parent.metrics.first_token_time is None:
                parent.metrics.first_token_time = now
            parent.metrics.last_token_time = now
            num_kept = len(tokens)
            if sample.detokenizer is not None:
                num_kept, stop = self._detokenize(sample.detokenizer, request, tokens)
                if stop:
                    stopped.append(request)
            for lp in out.logprobs.get(request.request_id, [])[:num_kept]:
                self._add_logprobs(sample, lp)
            touched[parent.request_id] = parent
        return list(touched.values()), stopped

    @staticmethod
    def _detokenize(detok: IncrementalDetokenizer, request: Request, tokens: list[int]
                    ) -> tuple[int, bool]:
        """Add the text of the request's new ``tokens`` one by one. Returns how many it
        keeps (a stop string's token is the last; the request drops those after it), and
        whether a stop string ends the (still running) request.

        The scheduler has already applied the token-level rules: a request it stopped on
        EOS or a stop token id gets no text from that token (vLLM's ``stop_terminated``,
        unless ``include_stop_str_in_output``). A request that ended gets its pending bytes
        flushed. As vLLM, a stop string found in the last token's text makes the finish
        reason ``stop`` even when ``max_tokens`` was reached by the same token.
        """
        for i, token in enumerate(tokens):
            last = i == len(tokens) - 1
            stop = detok.update([token], last and request.status == RequestStatus.FINISHED_STOPPED)
            if stop is None and last and request.is_finished:
                stop = detok.finish()
            if stop is not None:
                break
        else:
            return len(tokens), False
        request.stop_reason = stop
        request.drop_last_tokens(len(tokens) - 1 - i)
        if not request.is_finished:
            return i + 1, True
        request.status = RequestStatus.FINISHED_STOPPED  # its blocks are already free
        return i + 1, False

    @staticmethod
    def _index(parent: ParentState, request: Request) -> int:
        for s in parent.samples:
            if s.request is request:
                return s.index
        raise KeyError(request.request_id)

    def _decode(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    def _logprob_dict(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        entry = {lp.token_id: Logprob(lp.logprob, lp.rank, self._decode(lp.token_id))}
        for rank, (tid, value) in enumerate(zip(lp.top_ids, lp.top_logprobs), start=1):
            if tid not in entry:
                entry[tid] = Logprob(value, rank, self._decode(tid))
        return entry

    def _add_logprobs(self, sample: SampleState, lp: TokenLogprobs) -> None:
        sample.logprobs.append(self._logprob_dict(lp))
        sample.cumulative_logprob += lp.logprob

    def _add_prompt_logprobs(self, parent: ParentState, start: int, entries: list[TokenLogprobs]) -> None:
        for offset, lp in enumerate(entries):
            parent.prompt_logprobs[start + 1 + offset] = self._logprob_dict(lp)

    def make_output(self, parent: ParentState) -> RequestOutput:
        """The request's current state as a ``RequestOutput`` (cumulative, not a delta)."""
        outputs = []
        for s in parent.samples:
            req = s.request
            # Held-back tail: a partial stop string is never shown, so text only grows.
            text = ("" if s.detokenizer is None
                    else s.detokenizer.get_next_output_text(req.is_finished, delta=False))
            outputs.append(CompletionOutput(
                index=s.index,
                text=text,
                token_ids=list(req.output_token_ids),
                prompt_text_trim=0 if s.detokenizer is None else s.detokenizer.prompt_text_trim,
                cumulative_logprob=s.cumulative_logprob,
                logprobs=s.logprobs,
                finish_reason=req.status.finish_reason,
                stop_reason=req.stop_reason,
            ))
        finished = parent.finished
        if finished:
            parent.metrics.finished_time = time.monotonic()
            self.remove(parent)
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=parent.prompt_logprobs,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=parent.samples[0].request.num_cached_tokens,
            metrics=parent.metrics,
        )

    def remove(self, parent: ParentState) -> None:
        self.parents.pop(parent.request_id, None)
        for s in parent.samples:
            self.sample_to_parent.pop(s.request.request_id, None)
