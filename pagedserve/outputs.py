"""Results handed to callers, in vLLM's shapes (``RequestOutput``, ``CompletionOutput``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log probability (natural log), its 1-based rank in the model's
    distribution, and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: token id -> Logprob (the chosen token and the top-k alternatives).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One sample of a request.

    Attributes:
        index: sample number within the request (0 .. n-1).
        text: generated text (cut at a stop string).
        token_ids: generated token ids.
        cumulative_logprob: sum of the sampled tokens' logprobs, when logprobs were asked.
        logprobs: per generated token, when ``SamplingParams.logprobs`` is set.
        finish_reason: ``stop`` | ``length`` | ``abort`` once finished, else None.
        stop_reason: the stop string or stop token id that ended it, else None.
        prompt_text_trim: for ``echo`` (not in vLLM): how many characters at the end of
            ``decode(prompt_token_ids)`` this sample re-decodes differently. A prompt that
            ends inside a UTF-8 character decodes to U+FFFD there; when the output completes
            the character, the character belongs to ``text``, so the echoed prompt is
            ``decode(prompt)[:len - prompt_text_trim]`` and echo + ``text`` ==
            ``decode(prompt + output)``. 0 for any prompt that ends on a character boundary.
            Final once ``text`` is non-empty or the sample finished.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_text_trim: int = 0

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps of a request (seconds, ``time.monotonic`` clock)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """The state of one request: its prompt and every sample so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = field(default=None, repr=False)
