"""``POST /v1/completions``: OpenAI's legacy completions API, streaming or not.

Source: OpenAI API reference, "Completions" (request fields, ``text_completion`` objects,
legacy ``logprobs`` with ``tokens`` / ``token_logprobs`` / ``top_logprobs`` /
``text_offset``); vLLM's ``serving_completion.py`` for ``echo`` with logprobs (the first
prompt token has no logprob), ``echo`` with ``max_tokens: 0`` (run with one token, then drop
it: the prompt alone is the answer, as log-likelihood harnesses expect), ``prompt_logprobs``
per choice, and choice numbering (``prompt_index * n + sample_index``).
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from pagedserve.entrypoints.openai.errors import APIError, engine_error
from pagedserve.entrypoints.openai.protocol import UsageInfo
from pagedserve.entrypoints.openai.protocol_completion import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    PromptLogprob,
)
from pagedserve.entrypoints.openai.request_params import (
    add_requests,
    request_constraint,
    sampling_params,
)
from pagedserve.entrypoints.openai.serving_engine import ServingContext, clamp_logprob, random_id
from pagedserve.entrypoints.openai.streaming import (
    merge_streams,
    sse,
    sse_error,
    until_disconnected,
)
from pagedserve.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from pagedserve.tokenizer import encode_text


def normalize_prompts(prompt) -> list[str | dict]:
    """OpenAI's four prompt shapes -> engine prompts (text or ``{"prompt_token_ids"}``).

    Raises ``APIError`` 400 for an empty list."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be an empty list", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, int) for p in prompt):
        return [{"prompt_token_ids": list(prompt)}]
    return [{"prompt_token_ids": list(p)} for p in prompt]


class LogprobsBuilder:
    """Builds legacy ``CompletionLogProbs`` for consecutive tokens of one choice.

    ``top`` is the request's ``logprobs`` (N): each position lists the N most likely tokens
    plus the chosen one. ``text_offset`` continues across calls (streaming chunks).
    """

    def __init__(self, top: int, offset: int = 0) -> None:
        self.top = top
        self.offset = offset

    def build(self, token_ids: list[int], entries: list[dict[int, Logprob] | None],
              first_token_text: str | None = None) -> CompletionLogProbs:
        """``entries[i]`` is the logprob dict of ``token_ids[i]``; None only for the first
        prompt token under ``echo`` (its text is ``first_token_text``)."""
        lp = CompletionLogProbs()
        for tid, entry in zip(token_ids, entries):
            if entry is None or tid not in entry:
                text = first_token_text or ""
                lp.tokens.append(text)
                lp.token_logprobs.append(None)
                lp.top_logprobs.append(None)
            else:
                chosen = entry[tid]
                text = chosen.decoded_token or ""
                lp.tokens.append(text)
                lp.token_logprobs.append(clamp_logprob(chosen.logprob))
                top: dict[str, float] = {}
                for t, e in sorted(entry.items(), key=lambda kv: kv[1].rank or 0):
                    if t == tid or (e.rank is not None and e.rank <= self.top):
                        top[e.decoded_token or ""] = clamp_logprob(e.logprob)
                lp.top_logprobs.append(top)
            lp.text_offset.append(self.offset)
            self.offset += len(text)
        return lp


class OpenAIServingCompletion:
    """Handler of ``/v1/completions``."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create_completion(self, req: CompletionRequest, raw: Request) -> Response:
        """Answer one completions request. Raises ``APIError`` (400, 404, 503)."""
        arrival = time.monotonic()
        lora = self.ctx.resolve_model(req.model)
        batch = isinstance(req.prompt, list) and bool(req.prompt) and not isinstance(
            req.prompt[0], int)
        if req.suffix is not None:
            raise APIError(400, "suffix is not supported", param="suffix")
        n = req.n or 1
        if req.best_of is not None and req.best_of != n:
            raise APIError(400, "best_of must equal n: best-of sampling is not supported",
                           param="best_of")
        if req.max_tokens == 0 and not req.echo:
            raise APIError(400, "max_tokens must be >= 1 (0 only with echo, to score the "
                                "prompt); got 0", param="max_tokens")
        if req.prompt_logprobs is not None and req.stream:
            raise APIError(400, "prompt_logprobs are not available when stream is true",
                           param="prompt_logprobs")
        prompts = await self._tokenized(normalize_prompts(req.prompt), batch)
        # echo + logprobs needs the prompt's logprobs too: compute the larger top-N once.
        wanted = [v for v in (req.prompt_logprobs, req.logprobs if req.echo else None)
                  if v is not None]
        max_tokens = 1 if req.max_tokens == 0 else req.max_tokens
        constraint = request_constraint(req)
        params = sampling_params(req, max_tokens, req.logprobs, max(wanted, default=None),
                                 constraint)
        request_id = random_id("cmpl")
        streams = await add_requests(self.ctx.engine, request_id, prompts, params, arrival,
                                     indexed=batch, constraint=constraint,
                                     lora=functools.partial(self.ctx.current_lora, lora))
        model = self.ctx.model_name(lora)
        if req.stream:
            return StreamingResponse(self._stream(req, request_id, streams, n, model),
                                     media_type="text/event-stream")
        return await until_disconnected(raw, self._full(req, request_id, streams, n, model))

    async def _tokenized(self, prompts: list[str | dict], batch: bool) -> list[str | dict]:
        """Text prompts tokenized on the tokenizer thread (``{"prompt", "prompt_token_ids"}``):
        a long text must not stall the engine thread, which streams every other request.
        Raises ``APIError`` 400 naming ``prompt`` (``prompt[i]`` in a batch) for invalid text."""
        tok = self.ctx.tokenizer
        if tok is None:
            return prompts  # the engine rejects text prompts without a tokenizer
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                try:
                    p = {"prompt": p,
                         "prompt_token_ids": await self.ctx.run_tokenizer(encode_text, tok, p)}
                except ValueError as err:
                    param = f"prompt[{i}]" if batch else "prompt"
                    raise APIError(400, f"{param}: {err}" if batch else str(err),
                                   param=param) from err
            out.append(p)
        return out

    async def _echo_info(self, out: RequestOutput) -> tuple[str, str]:
        """(prompt text, text of the first prompt token) for ``echo``; the text of a sample
        is ``echo_prefix(prompt text, sample)`` + the sample's text."""
        tok = self.ctx.tokenizer
        if tok is None:
            return out.prompt or "", ""

        def decode() -> tuple[str, str]:
            text = out.prompt if out.prompt is not None else tok.decode(out.prompt_token_ids)
            return text, tok.decode(out.prompt_token_ids[:1])

        return await self.ctx.run_tokenizer(decode)

    async def _full(self, req: CompletionRequest, request_id: str, streams, n: int,
                    model: str) -> Response:
        finals: list[RequestOutput | None] = [None] * len(streams)
        try:
            async for i, out in merge_streams(streams):
                finals[i] = out
        except Exception as err:
            raise engine_error(err) from err
        choices, usage = [], UsageInfo()
        for i, out in enumerate(finals):
            prompt_text = first_token = ""
            if req.echo:
                prompt_text, first_token = await self._echo_info(out)
            usage.prompt_tokens += len(out.prompt_token_ids)
            prompt_logprobs = (None if req.prompt_logprobs is None
                               else _prompt_logprobs(out.prompt_logprobs, out.prompt_token_ids,
                                                     req.prompt_logprobs))
            for c in out.outputs:
                if req.max_tokens == 0:
                    c = _prompt_only(c)  # drop the one token it ran with
                usage.completion_tokens += len(c.token_ids)
                logprobs = None
                if req.logprobs is not None:
                    builder = LogprobsBuilder(req.logprobs)
                    token_ids, entries = list(c.token_ids), list(c.logprobs or [])
                    if req.echo:
                        token_ids = list(out.prompt_token_ids) + token_ids
                        entries = list(out.prompt_logprobs or []) + entries
                    logprobs = builder.build(token_ids, entries, first_token)
                text = echo_prefix(prompt_text, c) + c.text if req.echo else c.text
                choices.append(CompletionResponseChoice(
                    index=i * n + c.index, text=text, logprobs=logprobs,
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                    prompt_logprobs=prompt_logprobs))
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        body = CompletionResponse(id=request_id, model=model,
                                  choices=choices, usage=usage)
        return Response(body.model_dump_json(), media_type="application/json")

    async def _stream(self, req: CompletionRequest, request_id: str, streams,
                      n: int, model: str) -> AsyncIterator[str]:
        created = int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        builders: dict[int, LogprobsBuilder] = {}
        done: set[int] = set()
        prompt_tokens: dict[int, int] = {}
        completion_tokens: dict[int, int] = {}

        def chunk(choice: CompletionResponseStreamChoice) -> str:
            body = CompletionStreamResponse(id=request_id, created=created, model=model,
                                            choices=[choice])
            return sse(body.model_dump_json(exclude=None if include_usage else {"usage"}))

        try:
            async for i, out in merge_streams(streams):
                prompt_tokens[i] = len(out.prompt_token_ids)
                for c in out.outputs:
                    if req.max_tokens == 0:
                        c = _prompt_only(c)  # drop the one token it ran with
                    idx = i * n + c.index
                    completion_tokens[idx] = len(c.token_ids)
                    if idx in done:
                        continue
                    if idx not in sent_text and req.echo and not (c.text or c.finish_reason):
                        continue  # the echoed prompt's end is known once text exists
                    text, logprobs = c.text[sent_text.get(idx, 0):], None
                    if idx not in sent_text and req.echo:
                        prompt_text, first_token = await self._echo_info(out)
                        text = echo_prefix(prompt_text, c) + text
                        if req.logprobs is not None:
                            builders[idx] = LogprobsBuilder(req.logprobs)
                            logprobs = builders[idx].build(list(out.prompt_token_ids),
                                                           list(out.prompt_logprobs or []),
                                                           first_token)
                    sent_text[idx] = len(c.text)
                    if req.logprobs is not None:
                        start = sent_tokens.get(idx, 0)
                        builder = builders.setdefault(idx, LogprobsBuilder(req.logprobs))
                        new = builder.build(c.token_ids[start:], (c.logprobs or [])[start:])
                        sent_tokens[idx] = len(c.token_ids)
                        logprobs = _concat(logprobs, new)
                    has_tokens = logprobs is not None and logprobs.tokens
                    if not text and not has_tokens and c.finish_reason is None:
                        continue
                    if c.finish_reason is not None:
                        done.add(idx)
                    yield chunk(CompletionResponseStreamChoice(
                        index=idx, text=text, logprobs=logprobs, finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason))
            if include_usage:
                usage = UsageInfo(prompt_tokens=sum(prompt_tokens.values()),
                                  completion_tokens=sum(completion_tokens.values()))
                usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
                yield sse(CompletionStreamResponse(id=request_id, created=created, model=model,
                                                   choices=[], usage=usage).model_dump_json())
        except Exception as err:  # noqa: BLE001 - shutdown, step failure: tell the client in-band
            yield sse_error(err)
        yield sse("[DONE]")


def _prompt_only(c: CompletionOutput) -> CompletionOutput:
    """A ``max_tokens: 0`` choice: the engine ran it with one token, which is dropped here
    (vLLM's rule); it ended by length, having generated all 0 tokens it was allowed."""
    return replace(c, text="", token_ids=[], logprobs=None if c.logprobs is None else [],
                   cumulative_logprob=None if c.cumulative_logprob is None else 0.0,
                   finish_reason=c.finish_reason and "length", stop_reason=None,
                   prompt_text_trim=0)


def _prompt_logprobs(entries: PromptLogprobs | None, token_ids: list[int],
                     top: int) -> list[dict[int, PromptLogprob] | None]:
    """vLLM's choice-level ``prompt_logprobs``: None for the first prompt token, then per
    position the prompt token and the ``top`` most likely ones (rank <= top), logprobs
    clamped to -9999.0 as vLLM does."""
    out: list[dict[int, PromptLogprob] | None] = []
    for tid, entry in zip(token_ids, entries or [None] * len(token_ids)):
        if entry is None:
            out.append(None)
            continue
        out.append({t: PromptLogprob(logprob=clamp_logprob(e.logprob), rank=e.rank,
                                     decoded_token=e.decoded_token)
                    for t, e in entry.items()
                    if t == tid or (e.rank is not None and e.rank <= top)})
    return out


def echo_prefix(prompt_text: str, c: CompletionOutput) -> str:
    """The prompt text echoed before sample ``c``: the longest common prefix of
    ``decode(prompt)`` and ``decode(prompt + output)``, so that echo + ``c.text`` equals the
    latter even when the prompt ends inside a character that the output completes."""
    return prompt_text[: len(prompt_text) - c.prompt_text_trim]


def _concat(a: CompletionLogProbs | None, b: CompletionLogProbs) -> CompletionLogProbs:
    if a is None:
        return b
    return CompletionLogProbs(text_offset=a.text_offset + b.text_offset,
                              token_logprobs=a.token_logprobs + b.token_logprobs,
                              tokens=a.tokens + b.tokens,
                              top_logprobs=a.top_logprobs + b.top_logprobs)
