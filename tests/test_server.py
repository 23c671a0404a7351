"""The OpenAI-compatible server, end to end: a real `pagedserve serve` process on a free
loopback port, driven by the official `openai` client (and httpx for raw checks).

One server is shared by the whole module (the model loads once); the SIGTERM test runs
last and stops it. Greedy results are compared with the offline `LLM` API, loaded in this
process while the server starts. Every streamed greedy or seeded request sent through the
`client` and `http` fixtures is also checked against its non-streamed twin
(`stream_twins.py`).
"""

import asyncio
import gc
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import torch
from conftest import free_port, stop_process, wait_server_ready, wait_until
from prometheus_client.parser import text_string_to_metric_families
from stream_twins import (
    PATHS,
    AsyncTwinCheckTransport,
    TwinChecker,
    TwinCheckTransport,
    stream_result,
)

import pagedserve
from pagedserve import LLM, SamplingParams

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "test-key-123"
MAX_MODEL_LEN = 1024
MAX_TOKENS = 12
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "Name a color."}],
]
# The inputs of issue 12, items 3-5 (all greedy): path, body. Their offline token ids are in
# reference["text_cases"]; test_output_text_rules derives the expected text from them.
TEXT_CASES = {
    "stop_string": ("/v1/completions", {"prompt": "Here is the English alphabet: ABC",
                                        "max_tokens": 40, "stop": ["DEFGHIJ"]}),
    "emoji": ("/v1/completions", {"prompt": "My favourite emojis are 🎉👍", "max_tokens": 40}),
    # "Hello world " and 3 of the 4 bytes of a 4-byte emoji
    "partial_prompt": ("/v1/completions", {"prompt": [19556, 905, 15107, 230], "max_tokens": 8}),
    "stop_token": ("/v1/completions", {"prompt": "The theory of relativity was developed by",
                                       "max_tokens": 30, "stop_token_ids": [260]}),
    "eos": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Say OK."}],
                                     "max_tokens": 64, "skip_special_tokens": False}),
}
# n > 1 with a seed (issue 12): n different samples, the same set offline and over HTTP.
SEEDED_CHAT = [{"role": "user", "content": "Write a one-line slogan for a bakery."}]
SEEDED_PARAMS = SamplingParams(n=4, temperature=0.9, seed=7, max_tokens=30)
TOOLS_TEMPLATE = Path(__file__).parent / "smollm2_tools.jinja"
START_TIMEOUT = 600  # seconds; the shared 2-core machine can be very slow under load


class Server:
    def __init__(self, tmp: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / "server.log"
        self.log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", "--port",
             # the exact path: the offline reference batches differently
             str(self.port), "--dtype", "float32", "--quantization", "none", "--api-key",
             API_KEY, "--max-model-len", str(MAX_MODEL_LEN), "--uvicorn-log-level", "warning",
             # tools (issue 14): SmolLM2's own template plus hermes-style tools, rendering
             # exactly as the model's template when a request has no tools
             "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
             "--chat-template", str(TOOLS_TEMPLATE)],
            stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def log_text(self) -> str:
        return self.log_path.read_text()

    def wait_ready(self) -> None:
        wait_server_ready(self.proc, self.url, self.log_text, START_TIMEOUT)

    def stop(self) -> None:
        stop_process(self.proc)
        self.log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("server"))
    yield srv
    srv.stop()


def _offline(llm: LLM, path: str, body: dict):
    """The offline greedy result of a ``TEXT_CASES`` request."""
    fields = {k: v for k, v in body.items() if k not in ("prompt", "messages")}
    params = SamplingParams(temperature=0, **fields)
    if path == "/v1/chat/completions":
        return llm.chat(body["messages"], params, use_tqdm=False)[0]
    prompt = body["prompt"]
    prompt = {"prompt_token_ids": prompt} if isinstance(prompt, list) else prompt
    return llm.generate([prompt], params, use_tqdm=False)[0]


@pytest.fixture(scope="module")
def reference(server):
    """Offline greedy results, computed while the server loads (it started first)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # leave the other core to the server, which loads meanwhile
    try:
        llm = LLM(dtype="float32", quantization="none", max_model_len=MAX_MODEL_LEN)
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
        completions = llm.generate(PROMPTS, params, use_tqdm=False)
        chats = llm.chat(CHATS, params, use_tqdm=False)
        text_cases = {name: _offline(llm, path, body) for name, (path, body) in TEXT_CASES.items()}
        seeded = llm.chat([SEEDED_CHAT], SEEDED_PARAMS, use_tqdm=False)[0]
        tokenizer = llm.get_tokenizer()
        del llm
        gc.collect()
    finally:
        torch.set_num_threads(threads)
    return {"completions": completions, "chats": chats, "tokenizer": tokenizer,
            "text_cases": text_cases, "seeded": seeded}


@pytest.fixture(scope="module")
def ready(server, reference):
    """The server, once /health answers (the reference is computed first, while it loads)."""
    server.wait_ready()
    return server


@pytest.fixture(scope="module")
def twins():
    """Counts the streams checked against their non-streamed twins in this module."""
    return TwinChecker()


@pytest.fixture(scope="module")
def client(ready, twins):
    http_client = httpx.Client(transport=TwinCheckTransport(twins), timeout=300)
    return openai.OpenAI(base_url=ready.url + "/v1", api_key=API_KEY, max_retries=0,
                         timeout=300, http_client=http_client)


@pytest.fixture(scope="module")
def http(ready, twins):
    with httpx.Client(base_url=ready.url, timeout=300, transport=TwinCheckTransport(twins),
                      headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


def metrics(http: httpx.Client) -> dict:
    """Sample name + sorted labels -> value, from /metrics parsed by prometheus-client."""
    text = http.get("/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items()
                                  if k not in ("model_name", "engine")))
            out[(s.name, labels)] = s.value
    return out


def value(m: dict, name: str, **labels) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


WAIT = 300  # seconds: a deadline for conditions the server reaches soon, on a loaded machine


def wait_idle(http: httpx.Client, timeout: float = WAIT) -> dict:
    """Poll /metrics until no request runs or waits and the KV cache is empty; return the
    metrics then (fails the test after ``timeout`` s)."""
    def idle():
        m = metrics(http)
        return m if (value(m, "vllm:num_requests_running") == 0
                     and value(m, "vllm:num_requests_waiting") == 0
                     and value(m, "vllm:kv_cache_usage_perc") == 0) else None

    return wait_until(idle, timeout, "the server to be idle")


def wait_metric(http: httpx.Client, name: str, want: float, timeout: float = WAIT,
                **labels) -> dict:
    """Poll /metrics until ``name{labels}`` equals ``want``; return the metrics then."""
    def reached():
        m = metrics(http)
        return m if value(m, name, **labels) == want else None

    return wait_until(reached, timeout, f"{name}{labels or ''} == {want}")


# -- 1. results equal the offline API; streaming equals non-streaming -----------------------


def test_start_log(ready):
    log = ready.log_text()
    for needle in (MODEL, "device cpu", "dtype float32", "KV cache:", "blocks x 16 tokens",
                   f"http://127.0.0.1:{ready.port}/v1"):
        assert needle in log, log


def test_completions_match_offline_and_stream(client, reference):
    for prompt, ref in zip(PROMPTS, reference["completions"], strict=True):
        want = ref.outputs[0]
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                      temperature=0)
        assert r.object == "text_completion" and r.id.startswith("cmpl-")
        assert isinstance(r.created, int) and r.model == MODEL
        assert r.choices[0].text == want.text
        assert r.choices[0].finish_reason == want.finish_reason
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert r.usage.completion_tokens == len(want.token_ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

        chunks = list(client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        with_choices = [c for c in chunks if c.choices]
        assert "".join(c.choices[0].text for c in with_choices) == want.text
        reasons = [c.choices[0].finish_reason for c in with_choices]
        assert reasons[-1] == want.finish_reason and set(reasons[:-1]) <= {None}
        assert chunks[-1].choices == [] and chunks[-1].usage == r.usage
        assert len({c.id for c in chunks}) == 1


def test_chat_matches_offline_and_stream(client, reference):
    for messages, ref in zip(CHATS, reference["chats"], strict=True):
        want = ref.outputs[0]
        # list-of-parts content must render like the plain string
        sent = [dict(m, content=[{"type": "text", "text": m["content"]}])
                if m["role"] == "user" else m for m in messages]
        r = client.chat.completions.create(model=MODEL, messages=sent,
                                           max_completion_tokens=MAX_TOKENS, temperature=0)
        assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
        assert r.choices[0].message.role == "assistant"
        assert r.choices[0].message.content == want.text
        assert r.choices[0].finish_reason == want.finish_reason
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert r.usage.completion_tokens == len(want.token_ids)

        chunks = list(client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        assert all(c.object == "chat.completion.chunk" for c in chunks)
        assert chunks[0].choices[0].delta.role == "assistant"
        with_choices = [c for c in chunks if c.choices]
        assert "".join(c.choices[0].delta.content or "" for c in with_choices) == want.text
        reasons = [c.choices[0].finish_reason for c in with_choices]
        assert reasons[-1] == want.finish_reason and set(reasons[:-1]) <= {None}
        assert chunks[-1].choices == [] and chunks[-1].usage == r.usage


@pytest.mark.parametrize("stream", [False, True])
def test_seeded_n_samples_match_offline(client, reference, stream):
    """n = 4 with a seed: four different samples, the very ones LLM.chat draws (sample i
    with seed + i, vLLM's rule), streamed or not (the stream is also checked against its
    non-streamed twin)."""
    p = SEEDED_PARAMS
    r = client.chat.completions.create(
        model=MODEL, messages=SEEDED_CHAT, n=p.n, temperature=p.temperature, seed=p.seed,
        max_tokens=p.max_tokens, stream=stream)
    texts = [""] * p.n
    if stream:
        for chunk in r:
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
    else:
        for c in r.choices:
            texts[c.index] = c.message.content
    assert texts == [c.text for c in reference["seeded"].outputs]
    assert len(set(texts)) == p.n


def test_raw_sse_format(http):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for event in events[:-2]:
        assert event.startswith("data: ")
        chunk = json.loads(event[len("data: "):])
        assert chunk["object"] == "chat.completion.chunk" and "usage" not in chunk
        assert chunk["system_fingerprint"] is None and isinstance(chunk["created"], int)


def test_logprobs_formats(client):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for tok, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 2 and top[tok] == logprob == max(top.values())  # greedy: rank 1

    r = client.chat.completions.create(model=MODEL, messages=CHATS[0], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 4
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:
        assert c.logprob <= 0 and bytes(c.bytes).decode() == c.token
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token
        assert [t.logprob for t in c.top_logprobs] == sorted(
            (t.logprob for t in c.top_logprobs), reverse=True)


def test_models_version_tokenize(client, http, reference):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert http.get("/version").json() == {"version": pagedserve.__version__}
    tok = reference["tokenizer"]
    r = http.post("/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
    assert r["tokens"] == tok.encode("Hello world") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == MAX_MODEL_LEN
    assert http.post("/detokenize", json={"model": MODEL, "tokens": r["tokens"]}).json() == {
        "prompt": "Hello world"}
    r = http.post("/tokenize", json={"model": MODEL, "messages": CHATS[0]}).json()
    assert r["tokens"] == reference["chats"][0].prompt_token_ids


# -- output text rules (issue 12, items 3-5), streamed and not -------------------------------


def _rule_text(case: str, extra: dict, tok, prompt_ids: list[int], ids: list[int]) -> str:
    """The expected text, from ``tok.decode`` and the stated rules: the token that stopped
    the request adds no text unless ``include_stop_str_in_output``; the completion is
    decode(prompt + output) minus its longest common prefix with decode(prompt) (all of it
    with ``echo``); a stop string cuts the text before it."""
    skip = case != "eos"
    if case in ("stop_token", "eos") and not extra.get("include_stop_str_in_output"):
        ids = ids[:-1]
    full = tok.decode(prompt_ids + ids, skip_special_tokens=skip)
    if extra.get("echo"):
        return full
    common = os.path.commonprefix([full, tok.decode(prompt_ids, skip_special_tokens=skip)])
    text = full[len(common):]
    return text[: text.index("DEFGHIJ")] if case == "stop_string" else text


def test_text_cases_reach_their_edge(reference):
    """The inputs really hit the cases the rules are about."""
    tok, cases = reference["tokenizer"], reference["text_cases"]
    assert tok.decode(cases["stop_string"].outputs[0].token_ids).startswith("DEFGHIJ")
    emoji = cases["emoji"].outputs[0]
    assert emoji.finish_reason == "length" and tok.decode(emoji.token_ids).endswith("\ufffd")
    partial = cases["partial_prompt"]
    assert tok.decode(partial.prompt_token_ids + partial.outputs[0].token_ids).startswith(
        "Hello world \U0001f30d")  # the output completes the prompt's last character
    assert cases["stop_token"].outputs[0].token_ids[-1] == 260
    assert tok.decode([260]) == " the"
    assert cases["eos"].outputs[0].token_ids[-1] == tok.eos_token_id


TEXT_VARIANTS = [  # (case, extra request fields)
    ("stop_string", {}), ("emoji", {}), ("partial_prompt", {}), ("partial_prompt", {"echo": True}),
    ("stop_token", {}), ("stop_token", {"include_stop_str_in_output": True}),
    ("eos", {}), ("eos", {"include_stop_str_in_output": True}),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("case", "extra"), TEXT_VARIANTS)
def test_output_text_rules(http, reference, twins, case, extra, stream):
    path, body = TEXT_CASES[case]
    ref = reference["text_cases"][case]
    ids = ref.outputs[0].token_ids
    want = _rule_text(case, extra, reference["tokenizer"], ref.prompt_token_ids, ids)
    req = {"model": MODEL, "temperature": 0, **body, **extra}
    if stream:
        req |= {"stream": True, "stream_options": {"include_usage": True}}
    checked = twins.checked
    r = http.post(path, json=req)
    assert r.status_code == 200, r.text
    chat = PATHS[path]
    if stream:
        got = stream_result(r.content, chat)
        (choice,) = got["choices"].values()
        text, reason, usage = choice["text"], choice["finish_reason"], got["usage"]
        assert twins.checked == checked + 1  # and equal to its non-streamed twin
    else:
        (choice,) = r.json()["choices"]
        text = choice["message"]["content"] if chat else choice["text"]
        reason, usage = choice["finish_reason"], r.json()["usage"]
    assert text == want
    assert reason == ref.outputs[0].finish_reason
    assert usage["completion_tokens"] == len(ids)  # the stopping token still counts


def test_twin_check_catches_a_difference():
    """The stream == non-stream check fails on a stream that sent the start of a stop string
    (the bug of item 3), and passes and counts an equal one. No server needed."""
    sse = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in [
        {"choices": [{"index": 0, "text": "DEFG", "finish_reason": None}]},
        {"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}]) + b"data: [DONE]\n\n"

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if body.get("stream"):
            return httpx.Response(200, stream=httpx.ByteStream(sse))  # not read yet
        text = "" if body["prompt"] == "bug" else "DEFG"
        return httpx.Response(200, json={"choices": [
            {"index": 0, "text": text, "finish_reason": "stop"}]})

    twins = TwinChecker()
    transport = TwinCheckTransport(twins, httpx.MockTransport(handler))
    with httpx.Client(transport=transport, base_url="http://test") as c:
        body = {"model": MODEL, "temperature": 0, "stream": True}
        with pytest.raises(AssertionError, match="stream != non-stream"):
            c.post("/v1/completions", json=body | {"prompt": "bug"})
        assert c.post("/v1/completions", json=body | {"prompt": "ok"}).status_code == 200
        c.post("/v1/completions", json=body | {"prompt": "bug", "temperature": 1})  # not greedy
    assert twins.checked == 1

    async def send_async(prompt: str) -> None:
        transport = AsyncTwinCheckTransport(twins, httpx.MockTransport(handler))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            await c.post("/v1/completions", json=body | {"prompt": prompt})

    with pytest.raises(AssertionError, match="stream != non-stream"):
        asyncio.run(send_async("bug"))
    asyncio.run(send_async("ok"))
    assert twins.checked == 2


# -- 2. many concurrent streams are batched together ----------------------------------------


def test_64_concurrent_streams(ready, http, twins):
    before = metrics(http)

    async def main():
        client = openai.AsyncOpenAI(
            base_url=ready.url + "/v1", api_key=API_KEY, max_retries=0, timeout=600,
            http_client=httpx.AsyncClient(transport=AsyncTwinCheckTransport(twins), timeout=600))

        async def one(i):
            stream = await client.completions.create(
                model=MODEL, prompt=f"Item {i}:", max_tokens=6, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            text, usage, reason = "", None, None
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                    reason = chunk.choices[0].finish_reason or reason
                usage = chunk.usage or usage
            return text, usage, reason

        async with client:
            return await asyncio.gather(*(one(i) for i in range(64)))

    checked = twins.checked
    results = asyncio.run(main())
    assert len(results) == 64
    assert all(u.completion_tokens == 6 and reason == "length" for _, u, reason in results)
    assert twins.checked - checked == 64
    after = wait_idle(http)
    # The 64 streams and their 64 non-streamed twins.
    assert value(after, "vllm:request_success_total", finished_reason="length") - value(
        before, "vllm:request_success_total", finished_reason="length") == 2 * 64
    # Steps that produced a token for more than 32 sequences at once.
    def wide(m):
        return (value(m, "pagedserve:iteration_num_seqs_count")
                - value(m, "pagedserve:iteration_num_seqs_bucket", le="32.0"))
    assert wide(after) - wide(before) >= 1
    assert (value(after, "vllm:iteration_tokens_total_count")
            > value(before, "vllm:iteration_tokens_total_count"))
    big_steps = (value(after, "vllm:iteration_tokens_total_count")
                 - value(after, "vllm:iteration_tokens_total_bucket", le="32.0"))
    assert big_steps >= 1


# -- 3. a client that goes away aborts its request -------------------------------------------


def test_disconnect_aborts_and_frees_kv_cache(ready, http):
    before = wait_idle(http)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 900,
            "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        # Keep the line iterator referenced: a discarded httpx iterator closes the
        # connection at once (a disconnect, which is tested below, not yet).
        lines = r.iter_lines()
        events = []
        while len(events) < 3:
            line = next(lines)
            if line.startswith("data: "):
                events.append(line)
        wait_metric(http, "vllm:num_requests_running", 1)
    abort = value(before, "vllm:request_success_total", finished_reason="abort")
    wait_metric(http, "vllm:request_success_total", abort + 1, finished_reason="abort")
    m = wait_idle(http)
    assert value(m, "vllm:num_requests_running") == 0
    assert value(m, "vllm:kv_cache_usage_perc") == 0

    # Non-streaming: the client hangs up once the request runs (a raw socket, so that the
    # hang-up comes after the engine has the request however slow the machine is).
    body["stream"] = False
    payload = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", ready.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Authorization: Bearer " + API_KEY.encode() + b"\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        wait_metric(http, "vllm:num_requests_running", 1)
    wait_metric(http, "vllm:request_success_total", abort + 2, finished_reason="abort")
    m = wait_idle(http)
    assert value(m, "vllm:num_requests_running") == 0
    assert value(m, "vllm:kv_cache_usage_perc") == 0
    aborted = value(m, "vllm:request_success_total", finished_reason="abort") - abort
    assert aborted == 2
    tokens = value(m, "vllm:generation_tokens_total") - value(before, "vllm:generation_tokens_total")
    assert tokens < 2 * 900  # neither ran to the end


# -- 4. errors ------------------------------------------------------------------------------


def test_taken_port_fails_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "pagedserve.entrypoints.cli", "serve",
                               "--port", str(port)],
                              check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert f"cannot listen on http://127.0.0.1:{port}: Address already in use" in proc.stderr
    assert "KV cache" not in proc.stderr  # no model was loaded


LONG = list(range(100, 100 + MAX_MODEL_LEN + 5))
CHAT_OK = [{"role": "user", "content": "hi"}]
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12},
            "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Current time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                 "maxLength": 12}},
                       "required": ["city"], "additionalProperties": False}}},
]
ERROR_CASES = [
    # (method, path, json body or raw bytes, status, param)
    ("POST", "/v1/completions", b"{not json", 400, None),
    ("POST", "/v1/completions", b"", 400, None),
    ("POST", "/v1/completions", b"[1, 2]", 400, None),
    ("POST", "/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "temperature": "hot"}, 400,
     "temperature"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400,
     "temperature"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 2}, 400, "top_p"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400,
     "max_tokens"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "n": 1000}, 400, "n"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 50}, 400,
     "logprobs"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "user": 5}, 400, "user"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "stream": "yes"}, 400,
     "stream"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "x",
                                 "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": LONG}, 400, "prompt"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": MAX_MODEL_LEN},
     400, "prompt"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": [10**9]}, 400, "prompt"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("POST", "/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ("POST", "/v1/completions", {"model": "/no/such/model", "prompt": "x"}, 404, "model"),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "x",
                                                                    "content": "hi"}]},
     400, "messages[0].role"),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages[0].content"),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user"}]},
     400, "messages[1].content"),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": None}]}, 400, "messages[0].content"),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"content": "hi"}]}, 400,
     "messages[0].role"),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": CHAT_OK, "logprobs": True,
                                      "top_logprobs": 50}, 400, "top_logprobs"),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": CHAT_OK,
                                      "max_completion_tokens": -3}, 400,
     "max_completion_tokens"),
    ("POST", "/v1/chat/completions", {"model": "nope", "messages": CHAT_OK}, 404, "model"),
    ("POST", "/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
    # Tokenizer options are not template variables: they would turn the ids into tensors.
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": CHAT_OK,
                                      "chat_template_kwargs": {"return_tensors": "pt"}}, 400,
     "chat_template_kwargs"),
    ("POST", "/tokenize", {"model": MODEL, "messages": CHAT_OK,
                           "chat_template_kwargs": {"return_tensors": "np"}}, 400,
     "chat_template_kwargs"),
    ("POST", "/v1/chat/completions",
     b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "\\ud800"}]}',
     400, "messages[0].content"),
    ("POST", "/detokenize", {"model": MODEL, "tokens": [10**9]}, 400, "tokens"),
    ("GET", "/v1/no-such-route", None, 404, None),
    # A lone surrogate: valid JSON, not encodable as UTF-8.
    ("POST", "/v1/completions", b'{"model": "SmolLM2-135M-Instruct", "prompt": "\\ud800"}',
     400, "prompt"),
    ("POST", "/tokenize", b'{"model": "SmolLM2-135M-Instruct", "prompt": "\\ud800"}',
     400, "prompt"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"99999999": 5}},
     400, "logit_bias"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "stop_token_ids": [99999999],
                                 "min_tokens": 2}, 400, "stop_token_ids"),
    ("POST", "/v1/completions",
     b'{"model": "SmolLM2-135M-Instruct", "prompt": "x", "temperature": 1e999}', 400,
     "temperature"),
    # structured outputs and tools (issue 14)
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": CHAT_OK, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     400, "response_format"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "guided_regex": "a(b"}, 400,
     "guided_regex"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "x",
                                 "structured_outputs": {"grammar": "root ::= nope"}}, 400,
     "structured_outputs"),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "guided_choice": ["a"],
                                 "response_format": {"type": "json_object"}}, 400,
     "guided_choice"),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": CHAT_OK, "tools": TOOLS,
                                      "tool_choice": {"type": "function",
                                                      "function": {"name": "nope"}}},
     400, "tool_choice"),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": CHAT_OK,
                                      "tool_choice": "required"}, 400, "tool_choice"),
]


@pytest.mark.parametrize(("method", "path", "body", "status", "param"), ERROR_CASES)
def test_error_cases(http, method, path, body, status, param):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    if isinstance(body, bytes):
        kwargs["headers"] = {"Content-Type": "application/json"}
    r = http.request(method, path, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    if status == 404 and path.startswith("/v1/c"):
        assert err["code"] == "model_not_found"


@pytest.mark.parametrize(("body", "headers", "quoted"), [
    ("x" * 100_000, {"Content-Type": "text/plain"}, "got 'text/plain'"),
    ("x", {"Content-Type": "text/" + "x" * 5000}, "... (5007 characters)"),
    (json.dumps({"model": MODEL, "prompt": "x", "temperature": "h" * 100_000}),
     {"Content-Type": "application/json"}, "... (100002 characters)"),
])
def test_error_messages_do_not_echo_large_inputs(http, body, headers, quoted):
    r = http.post("/v1/completions", content=body, headers=headers)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert quoted in message and len(message) < 300, message


def _openai_error(message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"message": message, "type": "invalid_request_error", "param": param, "code": code}


@pytest.mark.parametrize(("headers", "got"), [
    ({"Content-Type": "application/x-www-form-urlencoded"},  # curl -d's default
     "'application/x-www-form-urlencoded'"),
    ({"Content-Type": "text/plain; charset=utf-8"}, "'text/plain; charset=utf-8'"),
    ({}, "no Content-Type header"),
])
def test_json_body_needs_the_json_content_type(http, headers, got):
    """A JSON body under another content type stays refused (a cross-site form may carry
    it: CVE-2021-32677); the error names the header it needs and the one it got (issue 32)."""
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1})
    r = http.post("/v1/completions", content=body, headers=headers)
    assert r.status_code == 400, r.text
    assert r.json()["error"] == _openai_error(
        f"The Content-Type header must be 'application/json'; got {got}")


@pytest.mark.parametrize(("body", "where"), [
    (b'{\n  "model": "SmolLM2-135M-Instruct",\n  "prompt": "x",\n  "max_tokens": 2,\n}',
     "line 5 column 1 (char 74)"),
    (b'{"prompt": "x", "max_tokens": 2,, "n": 1}', "line 1 column 33 (char 32)"),
])
def test_malformed_json_names_line_and_column(http, body, where):
    """The parser's message with the line and column where it stopped (issue 32)."""
    r = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"] == _openai_error(
        "We could not parse the JSON body of your request: Expecting property name enclosed "
        f"in double quotes: {where}")


def _too_long(prompt_tokens: int, max_tokens: int) -> str:
    return (f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds max_model_len "
            f"({MAX_MODEL_LEN})")


def _no_room(prompt_tokens: int) -> str:
    return (f"the prompt has {prompt_tokens} tokens; max_model_len is {MAX_MODEL_LEN}, so no "
            "token can be generated")


@pytest.mark.parametrize(("body", "error"), [
    # max_tokens alone exceeds max_model_len: OpenAI names max_tokens
    ({"prompt": [1, 2, 3], "max_tokens": MAX_MODEL_LEN + 1},
     _openai_error(_too_long(3, MAX_MODEL_LEN + 1), "max_tokens")),
    ({"prompt": [[1, 2], [3]], "max_tokens": 5000},
     _openai_error(_too_long(2, 5000), "max_tokens")),
    # else the prompt does not fit: context_length_exceeded
    ({"prompt": LONG[:1000], "max_tokens": MAX_MODEL_LEN},
     _openai_error(_too_long(1000, MAX_MODEL_LEN), "prompt", "context_length_exceeded")),
    ({"prompt": LONG[:1020]},  # max_tokens defaults to 16
     _openai_error(_too_long(1020, 16), "prompt", "context_length_exceeded")),
    ({"prompt": LONG}, _openai_error(_no_room(len(LONG)), "prompt", "context_length_exceeded")),
    ({"prompt": [[1, 2], LONG], "max_tokens": 2},
     _openai_error(f"prompt[1]: {_no_room(len(LONG))}", "prompt[1]", "context_length_exceeded")),
])
def test_completion_context_length_errors(http, body, error):
    r = http.post("/v1/completions", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"] == error


LONG_CHAT = [{"role": "user", "content": "word " * (MAX_MODEL_LEN + 50)}]


@pytest.mark.parametrize(("messages", "extra", "param", "code", "message"), [
    (CHAT_OK, {"max_tokens": MAX_MODEL_LEN + 1}, "max_tokens", None,
     lambda n: _too_long(n, MAX_MODEL_LEN + 1)),
    (CHAT_OK, {"max_completion_tokens": 5000}, "max_completion_tokens", None,
     lambda n: _too_long(n, 5000)),
    (CHAT_OK, {"max_completion_tokens": MAX_MODEL_LEN - 1}, "messages",
     "context_length_exceeded", lambda n: _too_long(n, MAX_MODEL_LEN - 1)),
    (LONG_CHAT, {}, "messages", "context_length_exceeded", _no_room),
])
def test_chat_context_length_errors(client, http, messages, extra, param, code, message):
    """As OpenAI answers, seen through its client: ``param`` names max_tokens (or
    max_completion_tokens, the field sent) when it alone exceeds max_model_len, else
    ``messages`` with ``code: context_length_exceeded`` (issue 32)."""
    n = len(http.post("/tokenize", json={"model": MODEL, "messages": messages}).json()["tokens"])
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=messages, **extra)
    assert (info.value.param, info.value.code) == (param, code)
    assert info.value.body == _openai_error(message(n), param, code)


def test_auth_and_openai_exceptions(ready, client):
    assert httpx.get(ready.url + "/health").status_code == 200  # open without a key
    assert httpx.get(ready.url + "/metrics").status_code == 200
    r = httpx.get(ready.url + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(ready.url + "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    bad_key = openai.OpenAI(base_url=ready.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=CHAT_OK, temperature=-1)
    # The server still answers, and unknown fields of no concern are ignored (as vLLM).
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2,
                                  extra_body={"some_future_field": {"x": 1}})
    assert r.usage.completion_tokens == 2


# -- 5. metrics -----------------------------------------------------------------------------

REQUIRED_METRICS = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success",
    "vllm:num_preemptions", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
    "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
    "vllm:iteration_tokens_total",
]


def test_metrics_parse_and_move(http, client):
    text = http.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in REQUIRED_METRICS:
        assert name in families, name
        for s in families[name].samples:
            assert s.labels["model_name"] == MODEL
    before = metrics(http)
    r = client.completions.create(model=MODEL, prompt="Hello, my name is", max_tokens=4,
                                  temperature=0, extra_body={"ignore_eos": True})
    after = wait_idle(http)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("vllm:prompt_tokens_total") == r.usage.prompt_tokens
    assert delta("vllm:generation_tokens_total") == 4
    assert delta("vllm:request_success_total", finished_reason="length") == 1
    assert delta("vllm:prefix_cache_queries_total") >= r.usage.prompt_tokens
    for hist in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds"):
        assert delta(hist + "_count") == 1
    assert delta("vllm:inter_token_latency_seconds_count") == 3
    assert delta("vllm:iteration_tokens_total_count") >= 4
    assert delta("vllm:iteration_tokens_total_sum") == r.usage.prompt_tokens + 4


# -- 6. scoring and prompt fields: echo + max_tokens 0, prompt_logprobs, truncation, chat echo --


def _hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """Row i: transformers' log-softmax over the vocabulary for the token after ids[:i+1]."""
    with torch.no_grad():
        return torch.log_softmax(hf_model(input_ids=torch.tensor([ids])).logits[0].float(), -1)


def _check_echo_logprobs(lp: dict, ids: list[int], ref: torch.Tensor, tok) -> None:
    """Legacy logprobs of an echoed prompt, as lm-evaluation-harness reads them."""
    assert lp["tokens"] == [tok.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for i in range(1, len(ids)):
        want = float(ref[i - 1, ids[i]])
        assert abs(lp["token_logprobs"][i] - want) < 1e-4, (i, lp["token_logprobs"][i], want)
        best = int(ref[i - 1].argmax())
        top = lp["top_logprobs"][i]  # logprobs=1: the most likely token, plus the prompt's
        assert set(top) == {tok.decode([best]), tok.decode([ids[i]])}
        assert abs(top[tok.decode([best])] - float(ref[i - 1, best])) < 1e-4
        assert top[lp["tokens"][i]] == lp["token_logprobs"][i]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]


def test_echo_max_tokens_0_scores_the_prompt(http, hf_model, reference):
    tok = reference["tokenizer"]
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 0, "echo": True,
            "logprobs": 1, "temperature": 0}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    ids = tok.encode(PROMPTS[0])
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    assert choice["text"] == PROMPTS[0] and choice["finish_reason"] == "length"
    assert choice["prompt_logprobs"] is None  # not asked for
    assert usage == {"prompt_tokens": len(ids), "completion_tokens": 0,
                     "total_tokens": len(ids)}
    _check_echo_logprobs(choice["logprobs"], ids, _hf_logprobs(hf_model, ids), tok)

    # A batch of token-id prompts, as lm-evaluation-harness's local-completions sends it.
    batch = [tok.encode(p) for p in ("The capital of France is Paris", "def fibonacci(n):")]
    r = http.post("/v1/completions", json=dict(body, prompt=batch)).json()
    assert [c["index"] for c in r["choices"]] == [0, 1]
    assert r["usage"]["completion_tokens"] == 0
    for ids, choice in zip(batch, r["choices"], strict=True):
        assert choice["text"] == tok.decode(ids)
        _check_echo_logprobs(choice["logprobs"], ids, _hf_logprobs(hf_model, ids), tok)

    # Streamed: one chunk per prompt with the prompt and its logprobs, ended by length.
    with http.stream("POST", "/v1/completions", json=dict(body, prompt=batch, stream=True)) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines()
                  if line.startswith("data: {")]
    assert sorted(e["choices"][0]["index"] for e in events) == [0, 1]
    for e in events:
        streamed, whole = e["choices"][0], r["choices"][e["choices"][0]["index"]]
        assert "prompt_logprobs" not in streamed
        assert streamed["text"] == whole["text"] and streamed["finish_reason"] == "length"
        assert streamed["logprobs"] == whole["logprobs"]

    r = http.post("/v1/completions", json=dict(body, echo=False))
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_prompt_logprobs_match_transformers(http, hf_model, reference):
    tok = reference["tokenizer"]
    ids = tok.encode(PROMPTS[1])
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 2, "temperature": 0,
            "prompt_logprobs": 2}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["prompt_logprobs"]
    ref = _hf_logprobs(hf_model, ids)
    assert len(got) == len(ids) and got[0] is None
    for i in range(1, len(ids)):
        row = ref[i - 1]
        top2 = row.topk(2).indices.tolist()
        assert set(got[i]) == {str(t) for t in (*top2, ids[i])}
        for key, entry in got[i].items():
            t = int(key)
            assert abs(entry["logprob"] - float(row[t])) < 1e-4
            assert entry["rank"] == int((row > row[t]).sum()) + 1
            assert entry["decoded_token"] == tok.decode([t])
    r = http.post("/v1/completions", json=dict(body, stream=True))
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


@pytest.mark.parametrize(("prompt", "index"), [
    (["Hello", "word " * (MAX_MODEL_LEN + 5), "Bye"], 1),
    ([[1, 2, 3], LONG, [4, 5]], 1),
    ([[1, 2, 3], [4, 5], [10**9]], 2),
    ([[1, 2, 3], []], 1),
])
def test_batch_prompt_error_names_the_index(http, prompt, index):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == f"prompt[{index}]" and err["message"].startswith(f"prompt[{index}]")
    # The prompts added before the bad one were aborted: nothing stays queued or cached.
    after = wait_idle(http)
    assert value(after, "vllm:num_requests_running") == 0
    assert value(after, "vllm:kv_cache_usage_perc") == 0
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_truncate_prompt_tokens(http, reference):
    tok = reference["tokenizer"]
    ids = tok.encode(" ".join(f"word{i}" for i in range(200)))[:120]
    body = {"model": MODEL, "max_tokens": 8, "temperature": 0}
    cut = http.post("/v1/completions", json=dict(body, prompt=ids, truncate_prompt_tokens=16))
    direct = http.post("/v1/completions", json=dict(body, prompt=ids[-16:])).json()
    assert cut.status_code == 200, cut.text
    assert cut.json()["usage"]["prompt_tokens"] == 16
    assert cut.json()["choices"][0]["text"] == direct["choices"][0]["text"]
    # An over-long prompt fits once truncated.
    r = http.post("/v1/completions", json=dict(body, prompt=LONG, truncate_prompt_tokens=16))
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 16
    # Chat: the last 16 tokens of the templated conversation.
    chat_ids = http.post("/tokenize", json={"model": MODEL, "messages": CHATS[1]}).json()["tokens"]
    r = http.post("/v1/chat/completions", json=dict(body, messages=CHATS[1],
                                                    truncate_prompt_tokens=16)).json()
    want = http.post("/v1/completions", json=dict(body, prompt=chat_ids[-16:])).json()
    assert r["usage"]["prompt_tokens"] == 16
    assert r["choices"][0]["message"]["content"] == want["choices"][0]["text"]
    for k in (MAX_MODEL_LEN + 1, 0, -2):
        r = http.post("/v1/chat/completions", json=dict(body, messages=CHATS[1],
                                                        truncate_prompt_tokens=k))
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


def test_chat_echo_prepends_the_assistant_message(http, reference):
    messages = [{"role": "user", "content": "Tell me one fact about the moon."},
                {"role": "assistant", "content": "The moon is"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0,
            "continue_final_message": True, "add_generation_prompt": False}
    plain = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    echoed = http.post("/v1/chat/completions", json=dict(body, echo=True)).json()
    assert plain["content"]  # something was generated after the prefix
    assert echoed["choices"][0]["message"]["content"] == "The moon is" + plain["content"]
    assert echoed["usage"]["completion_tokens"] == 8

    with http.stream("POST", "/v1/chat/completions",
                     json=dict(body, echo=True, stream=True)) as s:
        deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in s.iter_lines()
                  if line.startswith("data: {")]
    contents = [d["content"] for d in deltas if d.get("content")]
    assert deltas[0]["role"] == "assistant" and contents[0] == "The moon is"
    assert "".join(contents) == "The moon is" + plain["content"]

    # The last message is the user's: nothing to echo.
    r = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": CHATS[0], "max_tokens": MAX_TOKENS, "temperature": 0,
        "echo": True}).json()
    assert r["choices"][0]["message"]["content"] == reference["chats"][0].outputs[0].text


def test_cache_config_info(ready, http):
    """vLLM's info gauge: value 1, the cache configuration as labels; num_gpu_blocks is the
    pool the engine really built (its start log line)."""
    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    [sample] = families["vllm:cache_config_info"].samples
    blocks, block_size = re.search(r"KV cache: (\d+) blocks x (\d+) tokens",
                                   ready.log_text()).groups()
    assert sample.value == 1
    assert sample.labels == {
        "engine": "0", "block_size": block_size, "num_gpu_blocks": blocks,
        "cache_dtype": "auto", "enable_prefix_caching": "True",
        "gpu_memory_utilization": "None", "kv_cache_memory_bytes": "None",
        "num_gpu_blocks_override": "None", "memory_budget": "None"}
    assert block_size == "16" and int(blocks) > 0


# -- the OpenAPI document agrees with what the server accepts -------------------------------


@pytest.fixture(scope="module")
def openapi(http):
    r = http.get("/openapi.json")
    assert r.status_code == 200
    return r


@pytest.mark.parametrize(("path", "model"), [("/v1/completions", "CompletionRequest"),
                                             ("/v1/chat/completions", "ChatCompletionRequest")])
def test_openapi_examples_are_accepted(http, openapi, path, model):
    spec = openapi.json()
    ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert ref == {"$ref": f"#/components/schemas/{model}"}
    examples = spec["components"]["schemas"][model]["examples"]
    assert len(examples) >= 2
    for body in examples:
        r = http.post(path, json=body)
        assert r.status_code == 200, (body, r.text)


def test_openapi_bounds_messages_and_health(openapi):
    spec = json.loads(openapi.text)  # Python's json keeps big integers exact
    schemas = spec["components"]["schemas"]
    for model in ("CompletionRequest", "ChatCompletionRequest"):
        [seed] = [s for s in schemas[model]["properties"]["seed"]["anyOf"]
                  if s["type"] == "integer"]
        assert (seed["minimum"], seed["maximum"]) == (-(2**63), 2**64 - 1)
        assert type(seed["minimum"]) is int and type(seed["maximum"]) is int
    assert "e+" not in openapi.text  # no float exponent anywhere in the document
    # content is required (and not nullable) except on an assistant message
    for name in ("SystemMessage", "UserMessage", "ToolMessage"):
        assert "content" in schemas[name]["required"], name
        assert {"type": "null"} not in schemas[name]["properties"]["content"]["anyOf"]
    assert "content" not in schemas["AssistantMessage"].get("required", [])
    health = spec["paths"]["/health"]["get"]["responses"]
    assert set(health) == {"200", "503"} and all("content" not in r for r in health.values())
    errors = spec["paths"]["/v1/completions"]["post"]["responses"]
    assert "422" not in errors  # validation errors are 400s in OpenAI's format
    assert errors["4XX"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ErrorResponse"}


# -- structured outputs and tools (issue 14) ------------------------------------------------

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0,
                                                   "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
NO_WS = {"structured_outputs": {"disable_any_whitespace": True}}


def test_response_format_and_structured_outputs(client, twins):
    """Chat with OpenAI's response_format, completions with vLLM's fields; every result
    checked by jsonschema / re. Streamed: the twin check also runs each request
    non-streamed and compares text and finish_reason."""
    stream, checked = True, twins.checked
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a person in JSON."}],
        temperature=0, max_tokens=60, stream=stream, extra_body=NO_WS,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    text, finish = stream_result_text(chat, stream, chat=True)
    assert finish == "stop"
    jsonschema.validate(json.loads(text), PERSON)
    cases = [({"guided_choice": ["Paris", "London"]}, lambda t: t in ("Paris", "London")),
             ({"structured_outputs": {"regex": r"[0-9]{4}"}},
              lambda t: re.fullmatch(r"[0-9]{4}", t)),
             ({"response_format": {"type": "json_object"}, **NO_WS},
              lambda t: isinstance(json.loads(t), dict))]
    for extra, check in cases:
        out = client.completions.create(model=MODEL, prompt="The capital of France is",
                                        max_tokens=40, temperature=0, stream=stream,
                                        extra_body=extra)
        text, finish = stream_result_text(out, stream, chat=False)
        assert finish == "stop" and check(text), (extra, text)
    assert twins.checked == checked + 1 + len(cases)


def stream_result_text(result, stream: bool, chat: bool) -> tuple[str, str]:
    """(text, finish_reason) of choice 0 of an openai-client result, streamed or not."""
    if not stream:
        c = result.choices[0]
        return (c.message.content if chat else c.text), c.finish_reason
    text, finish = "", None
    for chunk in result:
        for c in chunk.choices:
            text += (c.delta.content or "") if chat else c.text
            finish = c.finish_reason or finish
    return text, finish


def _tool_calls(result, stream: bool) -> tuple[str | None, list[dict], str]:
    """(content, [{"id", "name", "arguments"}], finish_reason) of choice 0, rebuilt from
    OpenAI's tool-call deltas when streamed."""
    if not stream:
        msg = result.choices[0].message
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                 for c in msg.tool_calls or []]
        assert all(c.type == "function" for c in msg.tool_calls or [])
        return msg.content, calls, result.choices[0].finish_reason
    content, calls, finish = None, {}, None
    for chunk in result:
        for c in chunk.choices:
            if c.delta.content:
                content = (content or "") + c.delta.content
            for d in c.delta.tool_calls or []:
                if d.id is not None:  # a call's first delta: id, type, name
                    assert d.type == "function" and d.index not in calls
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                calls[d.index]["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


WEATHER_Q = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_named_and_required(client, stream):
    schema = TOOLS[0]["function"]["parameters"]
    named = client.chat.completions.create(
        model=MODEL, messages=WEATHER_Q, tools=TOOLS, temperature=0, max_tokens=60,
        stream=stream, extra_body=NO_WS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    content, calls, finish = _tool_calls(named, stream)
    assert (content, finish, [c["name"] for c in calls]) == (None, "stop", ["get_weather"])
    assert calls[0]["id"].startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(calls[0]["arguments"]), schema)

    required = client.chat.completions.create(
        model=MODEL, messages=WEATHER_Q, tools=TOOLS, tool_choice="required", temperature=0,
        max_tokens=80, stream=stream, parallel_tool_calls=False, extra_body=NO_WS)
    content, calls, finish = _tool_calls(required, stream)
    assert (content, finish, len(calls)) == (None, "tool_calls", 1)
    (tool,) = [t for t in TOOLS if t["function"]["name"] == calls[0]["name"]]
    jsonschema.validate(json.loads(calls[0]["arguments"]), tool["function"]["parameters"])


CALL = '{"name": "get_time", "arguments": {"city": "Paris"}}'


@pytest.mark.parametrize(("script", "content", "names", "stream"), [  # more: test_tool_parsers
    (f"<tool_call>\n{CALL}\n</tool_call>", None, ["get_time"], False),
    (f"Ok.<tool_call>{CALL}</tool_call>\n<tool_call>{CALL}</tool_call>", "Ok.",
     ["get_time", "get_time"], True),
])
def test_tool_choice_auto_parses_hermes_calls(client, stream, script, content, names):
    """The model's output is scripted (a one-choice constraint) so that the hermes parser
    sees a known text; the conversation also carries an earlier call and its result."""
    messages = [*WEATHER_Q,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 25 C"},
                {"role": "user", "content": "And in Paris?"}]
    out = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=100,
        stream=stream, extra_body={"structured_outputs": {"choice": [script]}})
    got_content, calls, finish = _tool_calls(out, stream)
    assert got_content == content
    assert [c["name"] for c in calls] == names
    assert all(json.loads(c["arguments"]) == {"city": "Paris"} for c in calls)
    assert finish == "tool_calls"


# -- shutdown (last: it stops the shared server) ------------------------------------------


def test_sigterm_aborts_in_flight_and_exits_zero(ready, http):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 900,
            "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        t0 = time.monotonic()
        ready.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][len("data: "):])["error"]["message"]
    assert ready.proc.wait(60) == 0
    print(f"exit {time.monotonic() - t0:.2f} s after SIGTERM")
    assert "shutting down" in ready.log_text()
