"""A request's parameters for the engine: its structured-output constraint and its
``SamplingParams``, and adding its prompts to the engine. Every value the request, the
constraint or the engine rejects becomes a 400 naming the request field at fault."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from pagedserve.engine.async_engine import AsyncLLM
from pagedserve.engine.request_stream import EngineClosedError, RequestStream
from pagedserve.entrypoints.openai.errors import APIError, bad_request
from pagedserve.entrypoints.openai.protocol import SamplingFields
from pagedserve.lora.request import LoRARequest
from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams

_SAMPLING_NAMES = {
    "structured_outputs", "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p",
    "top_k", "min_p", "seed", "stop", "stop_token_ids", "max_tokens", "min_tokens", "logprobs",
    "logit_bias", "prompt_logprobs", "truncate_prompt_tokens",
}


@dataclass
class Constraint:
    """A request's structured-output constraint and where it came from.

    Attributes:
        spec: the engine's constraint.
        param: the top-level request field it came from (``response_format``,
            ``structured_outputs``, ``guided_regex``, ``tool_choice``, ...).
        label: how error messages name the constraint's value (``guided_regex``,
            ``response_format.json_schema.schema``).
    """

    spec: StructuredOutputsParams
    param: str
    label: str

    def rename(self, err: APIError) -> APIError:
        """An engine error about ``structured_outputs.<kind>`` restated with this
        constraint's field (the engine names its own parameter)."""
        kind = self.spec.kinds()[0]
        prefix = f"structured_outputs.{kind}"
        if err.message.startswith(prefix):
            err.message = self.label + err.message[len(prefix):]
            err.param = self.param
        return err


_GUIDED = ("json", "regex", "choice", "grammar")


def request_constraint(req: SamplingFields, tool_schema: dict | None = None
                       ) -> Constraint | None:
    """The constraint of ``tool_choice`` (``tool_schema``, the schema of a forced tool
    call), ``response_format``, ``structured_outputs`` or a ``guided_*`` field, or None.
    ``structured_outputs`` with only ``disable_any_whitespace`` set adds that option to
    another constraint.

    Raises ``APIError`` 400 naming the field when several constraints are given or one is
    malformed."""
    found: list[tuple[str, str, dict]] = []
    if tool_schema is not None:
        found.append(("tool_choice", "tool_choice", {"json": tool_schema}))
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", "response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise APIError(400, "response_format of type json_schema needs json_schema.schema",
                           param="response_format")
        found.append(("response_format", "response_format.json_schema.schema",
                      {"json": fmt.json_schema.json_schema}))
    so = req.structured_outputs
    no_ws = bool(so and so.disable_any_whitespace)
    if so is not None:
        kinds = {"json": so.json_, "regex": so.regex, "choice": so.choice,
                 "grammar": so.grammar, "json_object": so.json_object or None}
        kinds = {k: v for k, v in kinds.items() if v is not None}
        if kinds or not found:
            found.append(("structured_outputs", "structured_outputs", kinds))
    for kind in _GUIDED:
        value = getattr(req, f"guided_{kind}")
        if value is not None:
            found.append((f"guided_{kind}", f"guided_{kind}", {kind: value}))
    if len(found) > 1:
        names = [f[0] for f in found]
        raise APIError(400, f"only one kind of constraint may be given; got {names}",
                       param=found[1][0])
    if not found:
        return None
    param, label, kwargs = found[0]
    try:
        spec = StructuredOutputsParams(**kwargs, disable_any_whitespace=no_ws)
    except ValueError as err:
        raise APIError(400, f"{param}: {err}", param=param) from err
    if param == "structured_outputs":
        label = f"structured_outputs.{spec.kinds()[0]}"
    return Constraint(spec, param, label)


def sampling_params(req: SamplingFields, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None = None,
                    constraint: Constraint | None = None) -> SamplingParams:
    """``SamplingParams`` of a request (None fields take their defaults), constrained by
    ``constraint`` if given.

    Raises ``APIError`` 400 naming the field for an out-of-range value."""
    def pick(value, default):
        return default if value is None else value

    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed when stream is true",
                       param="stream_options")
    try:
        return SamplingParams(
            n=pick(req.n, 1),
            presence_penalty=pick(req.presence_penalty, 0.0),
            frequency_penalty=pick(req.frequency_penalty, 0.0),
            repetition_penalty=pick(req.repetition_penalty, 1.0),
            temperature=pick(req.temperature, 1.0),
            top_p=pick(req.top_p, 1.0),
            top_k=pick(req.top_k, 0),
            min_p=pick(req.min_p, 0.0),
            seed=req.seed,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=pick(req.ignore_eos, False),
            max_tokens=max_tokens,
            min_tokens=pick(req.min_tokens, 0),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=pick(req.skip_special_tokens, True),
            spaces_between_special_tokens=pick(req.spaces_between_special_tokens, True),
            include_stop_str_in_output=pick(req.include_stop_str_in_output, False),
            logit_bias=req.logit_bias,
            truncate_prompt_tokens=req.truncate_prompt_tokens,
            structured_outputs=None if constraint is None else constraint.spec,
        )
    except ValueError as err:
        raise bad_request(err, _SAMPLING_NAMES) from err


# The engine's errors for a prompt that does not fit (``LLMEngine``'s checks of a request);
# group 1 is its max_model_len.
_TOO_LONG = (
    re.compile(r"prompt \(\d+ tokens\) \+ max_tokens \(\d+\) exceeds max_model_len \((\d+)\)"),
    re.compile(r"the prompt has \d+ tokens; max_model_len is (\d+), so no token can be generated"),
)


def _exceeded_max_model_len(message: str) -> int | None:
    """The max_model_len an engine error says the request exceeds, or None for another
    error."""
    for pattern in _TOO_LONG:
        match = pattern.fullmatch(message)
        if match:
            return int(match.group(1))
    return None


async def add_requests(engine: AsyncLLM, base_id: str, prompts: list, params: SamplingParams,
                       arrival_time: float, prompt_param: str = "prompt",
                       indexed: bool = False, constraint: Constraint | None = None,
                       max_tokens_param: str = "max_tokens",
                       lora: Callable[[], LoRARequest | None] | None = None
                       ) -> list[RequestStream]:
    """Add one engine request per prompt (ids ``base_id`` or ``base_id-i``); all or none.

    ``lora``: returns the requests' LoRA adapter (None: the base model), called right
    before each prompt goes to the engine, with no await in between
    (``ServingContext.current_lora``): it raises ``APIError`` 404 once the adapter is
    unloaded, so a request never reaches the engine after its adapter's removal.

    Raises ``APIError`` 400 for a prompt the engine rejects: ``param`` is the sampling field
    named in the message, else ``prompt_param``, or with ``indexed`` (a batch of prompts)
    ``prompt_param[i]``, which then also starts the message; a constraint that does not
    compile names ``constraint``'s field. A request longer than max_model_len is OpenAI's
    error: ``param`` is ``max_tokens_param`` (the request's field for ``params.max_tokens``)
    when max_tokens alone exceeds max_model_len, else the prompt's field, with code
    ``context_length_exceeded``. 503 when the engine is shutting down."""
    streams: list[RequestStream] = []
    i = 0
    try:
        for i, prompt in enumerate(prompts):
            rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
            lora_request = None if lora is None else lora()
            streams.append(await engine.add_request(rid, prompt, params, arrival_time,
                                                    lora_request=lora_request))
    except BaseException as err:
        for s in streams:
            s.abort()
        if isinstance(err, ValueError):
            api = bad_request(err, _SAMPLING_NAMES)
            if constraint is not None:
                api = constraint.rename(api)
            max_model_len = _exceeded_max_model_len(api.message)
            if max_model_len is not None:
                if params.max_tokens is not None and params.max_tokens > max_model_len:
                    api.param = max_tokens_param
                else:
                    api.code = "context_length_exceeded"
            if api.param is None:
                api.param = f"{prompt_param}[{i}]" if indexed else prompt_param
                if indexed:
                    api.message = f"{api.param}: {api.message}"
            raise api from err
        if isinstance(err, EngineClosedError):
            raise APIError(503, str(err)) from err
        raise
    return streams
