"""Per-request sampling parameters, with vLLM's names, defaults and semantics.

Source: ``vllm/sampling_params.py`` (``SamplingParams._verify_args``). Every invalid value
raises ``ValueError`` naming the field, the allowed range and the value got.
"""

from __future__ import annotations

import copy
import enum
import math
from dataclasses import dataclass, fields

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS).
# Ill-typed values raise ValueError too, not TypeError (hence the TRY004 noqa's): the
# project's rule is that bad input raises ValueError naming the field, as vLLM does.
SAMPLING_EPS = 1e-5


class SamplingType(enum.IntEnum):
    """How a request picks its tokens (vLLM's ``SamplingType``)."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _check_int(name: str, value: object, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int; got {value!r}")  # noqa: TRY004


def _as_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a float; got {value!r}")  # noqa: TRY004
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number; got {value!r}")
    return float(value)


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output to a JSON schema, a regex, a list of choices or a
    grammar (vLLM's ``StructuredOutputsParams``; compiled by xgrammar).

    Exactly one of the constraint fields must be set.

    Attributes:
        json: a JSON schema, as a dict or its JSON text.
        regex: a regular expression the whole output must match.
        choice: the output is exactly one of these strings.
        grammar: an EBNF (GBNF) grammar whose start rule is ``root``.
        json_object: any JSON object (``response_format={"type": "json_object"}``).
        disable_any_whitespace: JSON without free whitespace (``", "`` and ``": "``
            separators only); small models otherwise tend to emit whitespace forever.

    Raises:
        ValueError: no constraint or more than one, or an ill-typed field (naming it).
            A schema, regex or grammar that does not compile is reported by the engine's
            ``add_request``.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        set_kinds = self.kinds()
        if len(set_kinds) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, "
                             f"grammar, json_object; got {set_kinds or 'none'}")
        kind = set_kinds[0]
        value = getattr(self, kind)
        types = {"json": (str, dict), "regex": str, "grammar": str, "json_object": bool}
        if kind == "choice":
            if not isinstance(value, (list, tuple)) or not value or not all(
                    isinstance(c, str) for c in value):
                raise ValueError("structured_outputs.choice must be a non-empty list of "
                                 f"strings; got {value!r}")
            self.choice = list(value)
        elif not isinstance(value, types[kind]):
            raise ValueError(f"structured_outputs.{kind} has the wrong type; got {value!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            got = self.disable_any_whitespace
            raise ValueError(f"structured_outputs.disable_any_whitespace must be a bool; "  # noqa: TRY004
                             f"got {got!r}")

    def kinds(self) -> list[str]:
        """Names of the constraint fields that are set (``json_object`` counts when true)."""
        names = [f.name for f in fields(self) if f.name != "disable_any_whitespace"]
        return [n for n in names
                if getattr(self, n) is not None and getattr(self, n) is not False]


@dataclass
class SamplingParams:
    """Sampling parameters of one request (vLLM's ``SamplingParams``).

    Attributes:
        n: number of output sequences per prompt, >= 1.
        presence_penalty: subtracted from the logit of every token already in the output,
            in [-2, 2] (OpenAI semantics).
        frequency_penalty: subtracted once per occurrence in the output, in [-2, 2].
        repetition_penalty: > 0; logits of tokens seen in prompt or output are divided by
            it when positive and multiplied when negative (CTRL / HF semantics). 1 = off.
        temperature: >= 0; below 1e-5 means greedy (argmax).
        top_p: nucleus mass in (0, 1]; 1 = off.
        top_k: keep the k most likely tokens; 0 or -1 = off (stored as given).
        min_p: drop tokens whose probability is below ``min_p * max_prob``, in [0, 1].
        seed: per-request random seed; makes the request's samples reproducible,
            independent of the rest of the batch.
        stop: stop strings (a str is wrapped in a list); output text is cut before them.
        stop_token_ids: token ids that end generation (besides EOS).
        ignore_eos: keep generating after EOS.
        max_tokens: maximum number of output tokens, >= 1; None = up to max_model_len
            (the engine fills it in).
        min_tokens: EOS and stop tokens are masked until this many tokens are generated.
        logprobs: number of top log-probabilities returned per output token (0 = only the
            sampled token's), or None.
        prompt_logprobs: same, per prompt token, or None.
        detokenize: produce output text; stop strings need it.
        skip_special_tokens: drop special tokens from the output text.
        spaces_between_special_tokens: put spaces between adjacent special tokens.
        include_stop_str_in_output: keep the matched stop string at the end of the text.
        logit_bias: token id -> bias in [-100, 100] added to the logit (OpenAI semantics).
        truncate_prompt_tokens: keep only the last k prompt tokens (>= 1), or -1 for the
            last ``max_model_len``; None = no truncation. The engine raises ``ValueError``
            when k > max_model_len (vLLM's ``truncate_prompt_tokens``, left truncation).
        structured_outputs: constrain the output (``StructuredOutputsParams``), or None.

    Raises:
        ValueError: on any out-of-range or ill-typed value, naming the field.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty",
                     "temperature", "top_p", "min_p"):
            setattr(self, name, _as_float(name, getattr(self, name)))
        for name in ("n", "top_k", "min_tokens"):
            _check_int(name, getattr(self, name))
        for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs",
                     "truncate_prompt_tokens"):
            _check_int(name, getattr(self, name), optional=True)
        for name in ("ignore_eos", "detokenize", "skip_special_tokens",
                     "spaces_between_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                got = getattr(self, name)
                raise ValueError(f"{name} must be a bool; got {got!r}")  # noqa: TRY004
        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)
        self.logit_bias = self._normalise_logit_bias(self.logit_bias)
        self._verify_ranges()
        if self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams; got "
                             f"{self.structured_outputs!r}")

    @staticmethod
    def _normalise_stop(stop: object) -> list[str]:
        if stop is None:
            return []
        stops = [stop] if isinstance(stop, str) else list(stop)  # type: ignore[call-overload]
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must contain only non-empty strings; got {s!r}")
        return stops

    @staticmethod
    def _normalise_stop_token_ids(ids: object) -> list[int]:
        if ids is None:
            return []
        out = [ids] if isinstance(ids, int) and not isinstance(ids, bool) else list(ids)
        for t in out:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must be ints >= 0; got {t!r}")
        return out

    @staticmethod
    def _normalise_logit_bias(bias: object) -> dict[int, float] | None:
        if bias is None:
            return None
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be a dict[int, float]; got {bias!r}")  # noqa: TRY004
        out: dict[int, float] = {}
        for k, v in bias.items():
            try:  # OpenAI JSON sends keys as strings of digits
                tok = int(k) if not isinstance(k, bool) else None
            except (TypeError, ValueError):
                tok = None
            if tok is None or tok < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0; got {k!r}")
            val = _as_float("logit_bias value", v)
            if not -100.0 <= val <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100]; got {v!r}")
            out[tok] = val
        return out

    def _verify_ranges(self) -> None:
        checks = [
            ("n", self.n >= 1, ">= 1", self.n),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "in [-2, 2]",
             self.presence_penalty),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "in [-2, 2]",
             self.frequency_penalty),
            ("repetition_penalty", self.repetition_penalty > 0.0, "> 0",
             self.repetition_penalty),
            ("temperature", self.temperature >= 0.0, ">= 0", self.temperature),
            ("top_p", 0.0 < self.top_p <= 1.0, "in (0, 1]", self.top_p),
            ("top_k", self.top_k == -1 or self.top_k >= 0, "-1 (off) or >= 0", self.top_k),
            ("min_p", 0.0 <= self.min_p <= 1.0, "in [0, 1]", self.min_p),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, ">= 1",
             self.max_tokens),
            ("min_tokens", self.min_tokens >= 0, ">= 0", self.min_tokens),
            ("logprobs", self.logprobs is None or self.logprobs >= 0, ">= 0", self.logprobs),
            ("prompt_logprobs", self.prompt_logprobs is None or self.prompt_logprobs >= 0,
             ">= 0", self.prompt_logprobs),
            ("truncate_prompt_tokens", self.truncate_prompt_tokens in (None, -1)
             or self.truncate_prompt_tokens >= 1, "-1 or >= 1", self.truncate_prompt_tokens),
        ]
        for name, ok, allowed, got in checks:
            if not ok:  # NaN fails every comparison, so it lands here too
                raise ValueError(f"{name} must be {allowed}; got {got}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}); got {self.min_tokens}"
            )
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are only supported when detokenize is True; "
                             f"got stop={self.stop!r}")

    @property
    def is_greedy(self) -> bool:
        """True when the request samples by argmax (temperature < 1e-5, as vLLM)."""
        return self.temperature < SAMPLING_EPS

    @property
    def sampling_type(self) -> SamplingType:
        """GREEDY, RANDOM_SEED (seed given) or RANDOM."""
        if self.is_greedy:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    def clone(self) -> SamplingParams:
        """A deep copy (the engine mutates ``max_tokens``; stop lists are not shared)."""
        return copy.deepcopy(self)
