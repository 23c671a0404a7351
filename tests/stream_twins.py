"""A property checked on every streamed request of the server tests: a stream equals its
non-streamed twin (issue 12, "Done when").

Clients built on ``TwinCheckTransport`` (httpx, and through it the ``openai`` client) check
each streamed greedy (``temperature: 0``) or seeded request to ``/v1/completions`` or
``/v1/chat/completions``: once the stream has been read to ``data: [DONE]``, the same body is
sent without ``stream`` / ``stream_options`` and, per choice, the concatenated text, the
``finish_reason``, the ``stop_reason`` and the logprob tokens must equal the twin's, and the
stream's ``usage`` (when it carries one) the twin's usage. A stream left early, or one that
ends in an error or an aborted choice, is not checked (it has no complete twin).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import httpx

PATHS = {"/v1/completions": False, "/v1/chat/completions": True}  # path -> is chat


class TwinChecker:
    """Counts the streams checked (so a test can see that the check ran)."""

    def __init__(self) -> None:
        self.checked = 0


def twin_body(request: httpx.Request) -> dict | None:
    """The non-streamed twin of a streamed greedy or seeded request, else None."""
    if request.method != "POST" or request.url.path not in PATHS:
        return None
    try:
        body = json.loads(request.content)
    except ValueError:
        return None
    if not isinstance(body, dict) or body.get("stream") is not True:
        return None
    if body.get("temperature") != 0 and body.get("seed") is None:
        return None
    return {k: v for k, v in body.items() if k not in ("stream", "stream_options")}


def _logprob_tokens(choice: dict, chat: bool) -> list[str]:
    lp = choice.get("logprobs")
    if not lp:
        return []
    return [c["token"] for c in lp.get("content") or []] if chat else lp["tokens"]


def stream_result(raw: bytes, chat: bool) -> dict | None:
    """Choices (index -> text, finish_reason, stop_reason, logprob tokens) and usage of a
    complete SSE stream; None if it did not end with [DONE], carries an error, or a choice
    did not finish with ``stop`` or ``length``."""
    events = [e[len("data: "):] for e in raw.decode().split("\n\n") if e.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return None
    choices: dict[int, dict] = {}
    usage = None
    for event in events[:-1]:
        chunk = json.loads(event)
        if "error" in chunk:
            return None
        usage = chunk.get("usage") or usage
        for c in chunk["choices"]:
            s = choices.setdefault(c["index"], {"text": "", "finish_reason": None,
                                                "tokens": []})
            s["text"] += (c["delta"].get("content") or "") if chat else c["text"]
            s["tokens"] += _logprob_tokens(c, chat)
            if c.get("finish_reason") is not None:
                s["finish_reason"] = c["finish_reason"]
                if "stop_reason" in c:
                    s["stop_reason"] = c["stop_reason"]
    if any(s["finish_reason"] not in ("stop", "length") for s in choices.values()):
        return None
    return {"choices": choices, "usage": usage}


def compare(body: dict, chat: bool, streamed: dict, twin: dict) -> None:
    """Raise AssertionError where the stream differs from its twin's response ``twin``."""
    want = {}
    for c in twin["choices"]:
        text = c["message"]["content"] if chat else c["text"]
        want[c["index"]] = {"text": text or "", "finish_reason": c["finish_reason"],
                            "tokens": _logprob_tokens(c, chat)}
        if "stop_reason" in streamed["choices"].get(c["index"], {}):
            want[c["index"]]["stop_reason"] = c.get("stop_reason")
    assert streamed["choices"] == want, f"stream != non-stream for {body}"
    if streamed["usage"] is not None:
        assert streamed["usage"] == twin["usage"], f"stream usage != non-stream for {body}"


def _twin_request(request: httpx.Request, body: dict) -> httpx.Request:
    headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
    return httpx.Request("POST", request.url, headers=headers, json=body)


def _twin_response(response: httpx.Response, body: dict) -> dict:
    assert response.status_code == 200, f"non-stream twin of {body}: {response.text}"
    return response.json()


class _Tee:
    """The bytes of a stream so far; ``take()`` returns them up to ``data: [DONE]`` once,
    if they hold it (a complete stream), else None."""

    def __init__(self) -> None:
        self.raw = bytearray()
        self.taken = False

    def take(self) -> bytes | None:
        end = self.raw.find(b"data: [DONE]")
        if self.taken or end == -1:
            return None
        self.taken = True
        return bytes(self.raw[: end + len(b"data: [DONE]")])


class _SyncTee(httpx.SyncByteStream):
    """Passes chunks through; checks the stream at its end or when it is closed (the
    openai client closes the response right after [DONE], without reading further)."""

    def __init__(self, stream: httpx.SyncByteStream, check: Callable[[bytes], None]) -> None:
        self.stream, self.check, self.tee = stream, check, _Tee()

    def __iter__(self):
        for chunk in self.stream:
            self.tee.raw += chunk
            yield chunk
        self._end()

    def close(self) -> None:
        self.stream.close()
        self._end()

    def _end(self) -> None:
        raw = self.tee.take()
        if raw is not None:
            self.check(raw)


class _AsyncTee(httpx.AsyncByteStream):
    """The asyncio twin of ``_SyncTee``, except that it only hands the complete stream to
    ``done``: the openai client drains and closes a stream under a 0.1 s timeout that
    would cancel a twin request made there (``AsyncTwinCheckTransport.aclose`` checks)."""

    def __init__(self, stream: httpx.AsyncByteStream, done: Callable[[bytes], None]) -> None:
        self.stream, self.done, self.tee = stream, done, _Tee()

    async def __aiter__(self):
        async for chunk in self.stream:
            self.tee.raw += chunk
            yield chunk
        self._end()

    async def aclose(self) -> None:
        await self.stream.aclose()
        self._end()

    def _end(self) -> None:
        raw = self.tee.take()
        if raw is not None:
            self.done(raw)


class TwinCheckTransport(httpx.BaseTransport):
    """httpx transport that checks streams against their twins (see the module docstring)."""

    def __init__(self, checker: TwinChecker, inner: httpx.BaseTransport | None = None) -> None:
        self.checker = checker
        self.inner = inner or httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        body = twin_body(request)
        if body is None or response.status_code != 200:
            return response
        chat = PATHS[request.url.path]

        def check(raw: bytes) -> None:
            streamed = stream_result(raw, chat)
            if streamed is None:
                return
            twin = self.inner.handle_request(_twin_request(request, body))
            twin.read()
            compare(body, chat, streamed, _twin_response(twin, body))
            self.checker.checked += 1

        response.stream = _SyncTee(response.stream, check)
        return response

    def close(self) -> None:
        self.inner.close()


class AsyncTwinCheckTransport(httpx.AsyncBaseTransport):
    """The asyncio twin of ``TwinCheckTransport``: complete streams are checked when the
    client closes (``async with client:``), all twins at once."""

    def __init__(self, checker: TwinChecker,
                 inner: httpx.AsyncBaseTransport | None = None) -> None:
        self.checker = checker
        self.inner = inner or httpx.AsyncHTTPTransport()
        self.pending: list[tuple[httpx.Request, dict, bytes]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        body = twin_body(request)
        if body is not None and response.status_code == 200:
            response.stream = _AsyncTee(
                response.stream, lambda raw: self.pending.append((request, body, raw)))
        return response

    async def _check(self, request: httpx.Request, body: dict, raw: bytes) -> None:
        chat = PATHS[request.url.path]
        streamed = stream_result(raw, chat)
        if streamed is None:
            return
        twin = await self.inner.handle_async_request(_twin_request(request, body))
        await twin.aread()
        compare(body, chat, streamed, _twin_response(twin, body))
        self.checker.checked += 1

    async def aclose(self) -> None:
        pending, self.pending = self.pending, []
        try:
            await asyncio.gather(*(self._check(*p) for p in pending))
        finally:
            await self.inner.aclose()
