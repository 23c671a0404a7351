"""``POST /v1/chat/completions``: OpenAI's chat completions API, streaming or not.

Source: OpenAI API reference, "Chat Completions" (``chat.completion`` and
``chat.completion.chunk`` objects; the first delta carries ``role``; ``finish_reason`` in
the last chunk of each choice; with ``stream_options.include_usage`` a last chunk with
empty ``choices`` and the usage; logprobs as ``{"content": [{token, logprob, bytes,
top_logprobs}]}``). The prompt is the model's chat template with the generation prompt,
exactly as ``LLM.chat`` builds it. vLLM's ``serving_chat.py`` for ``echo``: the last
message's content starts the reply when that message is the assistant's.
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from pagedserve.entrypoints.openai.errors import APIError, engine_error
from pagedserve.entrypoints.openai.protocol import UsageInfo
from pagedserve.entrypoints.openai.protocol_chat import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    ChatMessageResponse,
    TopLogprob,
)
from pagedserve.entrypoints.openai.request_params import (
    add_requests,
    request_constraint,
    sampling_params,
)
from pagedserve.entrypoints.openai.serving_engine import (
    ServingContext,
    clamp_logprob,
    message_to_dict,
    random_id,
)
from pagedserve.entrypoints.openai.streaming import (
    merge_streams,
    sse,
    sse_error,
    until_disconnected,
)
from pagedserve.entrypoints.openai.tools import (
    DeltaStream,
    ToolMode,
    parse_output,
    tool_mode,
    tool_schema,
)
from pagedserve.outputs import Logprob, RequestOutput


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]],
                  top: int) -> ChatCompletionLogProbs:
    """Chat logprobs for ``token_ids``: each token with its ``top`` most likely
    alternatives (rank order); ``bytes`` are the UTF-8 bytes of the token text."""
    content = []
    for tid, entry in zip(token_ids, entries):
        chosen = entry.get(tid)
        if chosen is None:
            continue
        alternatives = sorted((e for e in entry.values() if e.rank is not None and e.rank <= top),
                              key=lambda e: e.rank)
        content.append(ChatCompletionLogProb(
            token=chosen.decoded_token or "", logprob=clamp_logprob(chosen.logprob),
            bytes=list((chosen.decoded_token or "").encode()),
            top_logprobs=[TopLogprob(token=e.decoded_token or "", logprob=clamp_logprob(e.logprob),
                                     bytes=list((e.decoded_token or "").encode()))
                          for e in alternatives[:top]]))
    return ChatCompletionLogProbs(content=content)


def echo_text(messages: list[ChatMessage]) -> str:
    """What ``echo`` prepends to the reply (vLLM's rule): the last message's content (text
    parts joined with newlines) when its role is the reply's (``assistant``), else ""."""
    last = messages[-1]
    if last.role != "assistant":
        return ""
    return message_to_dict(last, len(messages) - 1)["content"]


class OpenAIServingChat:
    """Handler of ``/v1/chat/completions``."""

    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create_chat_completion(self, req: ChatCompletionRequest, raw: Request) -> Response:
        """Answer one chat request. Raises ``APIError`` (400, 404, 503)."""
        arrival = time.monotonic()
        lora = self.ctx.resolve_model(req.model)
        mode = tool_mode(req, self.ctx.enable_auto_tool_choice)
        constraint = request_constraint(req, tool_schema(mode, req.parallel_tool_calls is not False))
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
        top = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens or req.max_tokens
        params = sampling_params(req, max_tokens, top, constraint=constraint)
        add_generation_prompt = req.add_generation_prompt is not False
        prompt_ids = await self.ctx.run_tokenizer(
            self.ctx.apply_chat_template, req.messages, add_generation_prompt,
            bool(req.continue_final_message), req.chat_template_kwargs, mode.tools)
        request_id = random_id("chatcmpl")
        streams = await add_requests(self.ctx.engine, request_id,
                                     [{"prompt_token_ids": prompt_ids}], params, arrival,
                                     prompt_param="messages", constraint=constraint,
                                     max_tokens_param=("max_completion_tokens"
                                                       if req.max_completion_tokens
                                                       else "max_tokens"),
                                     lora=functools.partial(self.ctx.current_lora, lora))
        echo = echo_text(req.messages) if req.echo else ""
        model = self.ctx.model_name(lora)
        if req.stream:
            return StreamingResponse(
                self._stream(req, request_id, streams, top, echo, mode, model),
                media_type="text/event-stream")
        return await until_disconnected(
            raw, self._full(request_id, streams, top, echo, mode, model))

    async def _full(self, request_id: str, streams, top: int | None, echo: str,
                    mode: ToolMode, model: str) -> Response:
        final: RequestOutput | None = None
        try:
            async for _, out in merge_streams(streams):
                final = out
        except Exception as err:
            raise engine_error(err) from err
        choices = []
        usage = UsageInfo(prompt_tokens=len(final.prompt_token_ids))
        for c in final.outputs:
            usage.completion_tokens += len(c.token_ids)
            logprobs = (chat_logprobs(c.token_ids, c.logprobs or [], top)
                        if top is not None else None)
            content, calls, finish_reason = parse_output(mode, echo + c.text, c.finish_reason)
            choices.append(ChatCompletionResponseChoice(
                index=c.index, message=ChatMessageResponse(content=content, tool_calls=calls),
                logprobs=logprobs, finish_reason=finish_reason, stop_reason=c.stop_reason))
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        body = ChatCompletionResponse(id=request_id, model=model,
                                      choices=choices, usage=usage)
        return Response(body.model_dump_json(), media_type="application/json")

    async def _stream(self, req: ChatCompletionRequest, request_id: str, streams,
                      top: int | None, echo: str, mode: ToolMode,
                      model: str) -> AsyncIterator[str]:
        created = int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        n = req.n or 1
        sent_text = [0] * n
        sent_tokens = [0] * n
        done: set[int] = set()
        usage = UsageInfo()
        deltas = [DeltaStream(mode) for _ in range(n)]

        def chunk(choice: ChatCompletionStreamChoice) -> str:
            body = ChatCompletionStreamResponse(id=request_id, created=created, model=model,
                                                choices=[choice])
            return sse(body.model_dump_json(exclude=None if include_usage else {"usage"}))

        try:
            for i in range(n):
                yield chunk(ChatCompletionStreamChoice(
                    index=i, delta={"role": "assistant", "content": ""}))
            for i in range(n if echo else 0):  # the echoed message is the first content
                for delta in deltas[i].feed(echo):
                    yield chunk(ChatCompletionStreamChoice(index=i, delta=delta))
            async for _, out in merge_streams(streams):
                usage.prompt_tokens = len(out.prompt_token_ids)
                usage.completion_tokens = sum(len(c.token_ids) for c in out.outputs)
                for c in out.outputs:
                    i = c.index
                    if i in done:
                        continue
                    text = c.text[sent_text[i]:]
                    sent_text[i] = len(c.text)
                    logprobs = None
                    if top is not None:
                        start = sent_tokens[i]
                        logprobs = chat_logprobs(c.token_ids[start:], (c.logprobs or [])[start:],
                                                 top)
                        sent_tokens[i] = len(c.token_ids)
                    new = deltas[i].feed(text) if text else []
                    finish_reason = None
                    if c.finish_reason is not None:
                        done.add(i)
                        last, finish_reason = deltas[i].finish(c.finish_reason)
                        new += last
                    if not new and not (logprobs and logprobs.content) and not finish_reason:
                        continue
                    # logprobs ride on the first chunk, finish_reason on the last
                    new = new or [{}]
                    for k, delta in enumerate(new):
                        yield chunk(ChatCompletionStreamChoice(
                            index=i, delta=delta, logprobs=logprobs if k == 0 else None,
                            finish_reason=finish_reason if k == len(new) - 1 else None))
            if include_usage:
                usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
                yield sse(ChatCompletionStreamResponse(
                    id=request_id, created=created, model=model, choices=[],
                    usage=usage).model_dump_json())
        except Exception as err:  # noqa: BLE001 - shutdown, step failure: tell the client in-band
            yield sse_error(err)
        yield sse("[DONE]")
