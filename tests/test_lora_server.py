"""LoRA adapters over HTTP (issue 30): a real `pagedserve serve --enable-lora` process on a
tiny random-weight Llama (a word-level tokenizer: token i is the word ``t<i>``) with PEFT
adapters made here (``init_lora_weights=False``, so that B is not zero).

The reference is PEFT itself: each adapter's greedy tokens come from the ``PeftModel`` that
saved it (float32, full forward per token). The server process starts first and imports
its modules while this process makes the model and the adapters (importing transformers
and peft takes several seconds on each side), then serves them. One server is shared by
the module; tests that load or unload adapters at runtime use names of their
own, so the static ones (``a``, ``b``) stay as started. The last tests run in-process:
runtime endpoints without the flag, the flags' parsing, and a server refusing to start
with a bad adapter.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from conftest import free_port, stop_process, wait_server_ready
from prometheus_client.parser import text_string_to_metric_families

VOCAB = 96
SERVED = "tiny"
PROMPT = "t3 t4 t5"
PROMPT_IDS = [3, 4, 5]
MAX_TOKENS = 8
# A stream that outlives the runtime loads and unloads done beside it (the prompt is 3
# tokens: it nearly fills MAX_MODEL_LEN). The tiny model decodes a token in well under a
# millisecond on a fast core: 400 tokens sometimes ended before an adapter had loaded.
LONG_TOKENS = 4000
MAX_MODEL_LEN = 4096
START_TIMEOUT = 600  # seconds; the shared 2-core machine can be very slow under load
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
# name -> (rank, alpha, target modules, use_rslora); "big" exceeds --max-lora-rank 8
ADAPTERS = {
    "a": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj"], False),
    "b": (4, 8, ["gate_proj", "up_proj", "down_proj"], True),
    "c": (8, 32, ["q_proj", "v_proj", "gate_proj", "down_proj"], False),
    "big": (16, 16, ["q_proj"], False),
}


def token_ids(text: str) -> list[int]:
    """The ids of a generated text (each token decodes to ``t<id>``, spaced or not)."""
    return [int(i) for i in re.findall(r"t(\d+)", text)]


def peft_greedy(model, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens of ``model`` (a full forward per token, no cache)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def make_files(root: Path) -> dict[str | None, list[int]]:
    """Write the base model directory (``base``, with its tokenizer), the chat template
    and one PEFT directory per ``ADAPTERS`` entry under ``root`` (``paths(root)``);
    returns PEFT's greedy tokens of ``PROMPT`` per adapter (None: the base model)."""
    import peft
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    out = paths(root)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_MODEL_LEN,
        rms_norm_eps=1e-5, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger weights than the default init: clearer argmax margins
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    model.save_pretrained(out["base"])
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=words).save_pretrained(out["base"])
    out["template"].write_text(CHAT_TEMPLATE)
    refs = {None: peft_greedy(model, PROMPT_IDS, MAX_TOKENS)}
    for name, (rank, alpha, targets, rslora) in ADAPTERS.items():
        lora = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(
            r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
            init_lora_weights=False)).eval()
        lora.save_pretrained(out[name])
        refs[name] = peft_greedy(lora, PROMPT_IDS, MAX_TOKENS)
    return refs


def paths(root: Path) -> dict[str, Path]:
    """Where ``make_files`` writes: ``base``, ``template`` and each adapter by name."""
    return {"base": root / "base", "template": root / "template.jinja",
            **{name: root / name for name in ADAPTERS}}


# Run in the server's process: import what serving needs, wait for the files, serve.
SERVE_WHEN_READY = """
import pathlib, sys, time
from pagedserve.entrypoints.cli import main
import pagedserve.entrypoints.openai.api_server
ready = pathlib.Path(sys.argv[1])
while not ready.exists():
    time.sleep(0.05)
sys.exit(main(sys.argv[2:]))
"""


class Server:
    """``pagedserve serve`` on the tiny model with adapters ``a`` (name=path) and ``b``
    (vLLM's JSON form), runtime updating allowed; it serves once ``ready`` exists."""

    def __init__(self, files: dict[str, Path], ready: Path, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        b = json.dumps({"name": "b", "path": str(files["b"]), "base_model_name": SERVED})
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", SERVE_WHEN_READY, str(ready),
                 "serve", str(files["base"]),
                 "--port", str(self.port), "--served-model-name", SERVED, "--dtype", "float32",
                 "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", str(8 << 20),
                 "--chat-template", str(files["template"]), "--uvicorn-log-level", "warning",
                 "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                 "--max-cpu-loras", "4", "--allow-runtime-lora-updating",
                 "--lora-modules", f"a={files['a']}", b],
                stdout=log, stderr=subprocess.STDOUT,
                # one thread is plenty for this model, and does not slow to a crawl on a
                # machine whose cores are busy (OpenMP's workers wait for each other)
                env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"))

    def wait_ready(self) -> None:
        wait_server_ready(self.proc, self.url, self.log_path.read_text, START_TIMEOUT)

    def stop(self) -> None:
        stop_process(self.proc)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    return paths(tmp_path_factory.mktemp("lora_server"))


@pytest.fixture(scope="module")
def server(files, tmp_path_factory):
    """The server, started before the files exist; ``server.refs``: ``make_files``'."""
    root = files["base"].parent
    srv = Server(files, root / "ready", root / "server.log")
    try:
        srv.refs = make_files(root)
        (root / "ready").touch()
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def refs(server) -> dict[str | None, list[int]]:
    """PEFT's greedy tokens of ``PROMPT`` per adapter (None: the base model)."""
    return server.refs


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def complete(http: httpx.Client, model: str | None, max_tokens: int = MAX_TOKENS,
             **extra) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            **extra}
    if model is not None:
        body["model"] = model
    return http.post("/v1/completions", json=body)


def completion_tokens(http: httpx.Client, model: str | None) -> list[int]:
    r = complete(http, model)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == (model or SERVED)
    return token_ids(r.json()["choices"][0]["text"])


def models(http: httpx.Client) -> dict[str, dict]:
    r = http.get("/v1/models")
    assert r.status_code == 200, r.text
    return {card["id"]: card for card in r.json()["data"]}


def load(http: httpx.Client, name: str, path) -> httpx.Response:
    return http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})


def unload(http: httpx.Client, name: str) -> httpx.Response:
    return http.post("/v1/unload_lora_adapter", json={"lora_name": name})


def assert_error(r: httpx.Response, status: int, *fragments: str) -> dict:
    """OpenAI's error body with ``status``, its message holding every fragment."""
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for fragment in fragments:
        assert fragment in error["message"], error
    return error


# -- the served adapters -------------------------------------------------------------------


def test_models_lists_the_adapters_under_the_base(http, files):
    cards = models(http)
    assert list(cards)[:3] == [SERVED, "a", "b"]
    assert cards[SERVED]["parent"] is None and cards[SERVED]["max_model_len"] == MAX_MODEL_LEN
    for name in ("a", "b"):
        assert cards[name]["parent"] == SERVED
        assert cards[name]["root"] == str(files[name])
        assert cards[name]["object"] == "model"
    one = http.get("/v1/models/a")
    assert one.status_code == 200 and one.json()["root"] == str(files["a"])
    assert_error(http.get("/v1/models/nope"), 404, "The model `nope` does not exist.")


def test_each_adapter_matches_peft_also_in_one_batch(http, refs):
    assert refs["a"] != refs[None] and refs["b"] != refs[None]  # the adapters do something
    for model in (None, SERVED, "a", "b"):
        assert completion_tokens(http, model) == refs[model if model != SERVED else None]
    # all at once: one engine step mixes the base and both adapters (--max-loras 2)
    names = [None, "a", "b", "a", None, "b"]
    with ThreadPoolExecutor(len(names)) as pool:
        got = list(pool.map(lambda m: completion_tokens(http, m), names))
    assert got == [refs[m] for m in names]


def test_streaming_and_chat_pick_the_adapter(http, refs):
    body = {"model": "b", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}
    text, models_seen = "", set()
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                models_seen.add(chunk["model"])
                text += chunk["choices"][0]["text"]
    assert token_ids(text) == refs["b"] and models_seen == {"b"}
    # the template renders "t3 t4 t5 ": the same prompt tokens
    r = http.post("/v1/chat/completions", json={
        "model": "a", "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "a"
    assert token_ids(r.json()["choices"][0]["message"]["content"]) == refs["a"]


def test_unknown_model_is_404(http):
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "t1"}]})):
        error = assert_error(http.post(path, json={**body, "model": "nope", "max_tokens": 2}),
                             404, "The model `nope` does not exist.")
        assert error["param"] == "model" and error["code"] == "model_not_found"


# -- loading and unloading at runtime --------------------------------------------------------


def test_load_bad_adapters_is_400_and_leaves_nothing(http, files, refs, tmp_path):
    assert_error(load(http, "x", tmp_path / "missing"), 400, "no such directory",
                 str(tmp_path / "missing"))
    assert_error(load(http, "x", files["big"]), 400, "rank 16", "max_lora_rank 8")
    assert_error(http.post("/v1/load_lora_adapter", json={"lora_name": "x"}), 400, "lora_path")
    assert_error(load(http, "a", files["c"]), 400, "The lora adapter 'a' has already been loaded.")
    assert_error(load(http, SERVED, files["c"]), 400, "base model")
    assert "x" not in models(http)
    assert_error(complete(http, "x"), 404, "The model `x` does not exist.")
    # the name is free: a good adapter loads under it
    assert load(http, "x", files["c"]).status_code == 200
    assert completion_tokens(http, "x") == refs["c"]
    assert unload(http, "x").status_code == 200


def test_unload_unknown_is_404(http):
    assert_error(unload(http, "zzz"), 404, "The lora adapter 'zzz' cannot be found.")


def test_load_and_unload_while_another_adapter_streams(http, files, refs, server):
    """A long stream with a runtime adapter; beside it: its unload is refused (409, in
    use), another adapter loads and serves, metrics and the dashboard name the adapter.
    The stream ends with the tokens it gets alone; then the unload succeeds, the name is a
    404, and loading it again serves again."""
    r = load(http, "s", files["a"])
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 's' added successfully."
    chunks: list[str] = []
    first = threading.Event()

    def stream() -> None:
        body = {"model": "s", "prompt": PROMPT, "max_tokens": LONG_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:])["choices"][0]["text"])
                    first.set()

    reader = threading.Thread(target=stream)
    reader.start()
    try:
        assert first.wait(120), "the stream never started"
        error = assert_error(unload(http, "s"), 409, "in use")
        assert error["param"] == "lora_name"
        assert "s" in models(http)
        state = http.get("/dashboard/state").json()
        assert state["lora"] and [row["lora_name"] for row in state["running"]] == ["s"]
        info = lora_info(http)
        assert info["max_lora"] == "2" and info["running_lora_adapters"] == "s"
        r = load(http, "c", files["c"])
        assert r.status_code == 200, r.text
        assert reader.is_alive(), f"the stream ended too soon ({LONG_TOKENS} tokens)"
        assert models(http)["c"]["parent"] == SERVED
        assert completion_tokens(http, "c") == refs["c"]
    finally:
        reader.join(300)
    streamed = token_ids("".join(chunks))
    assert len(streamed) == LONG_TOKENS and streamed[:MAX_TOKENS] == refs["a"]
    alone = complete(http, "s", max_tokens=LONG_TOKENS)
    assert token_ids(alone.json()["choices"][0]["text"]) == streamed
    r = unload(http, "s")
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 's' removed successfully."
    assert "s" not in models(http)
    assert_error(complete(http, "s"), 404, "The model `s` does not exist.")
    assert load(http, "s", files["b"]).status_code == 200  # the name again, other files
    assert completion_tokens(http, "s") == refs["b"]
    for name in ("s", "c"):
        assert unload(http, name).status_code == 200


def lora_info(http: httpx.Client) -> dict[str, str]:
    """The labels of the newest ``vllm:lora_requests_info`` sample (its value: the time)."""
    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    samples = families["vllm:lora_requests_info"].samples
    assert samples and all(s.value > time.time() - 3600 for s in samples)
    return max(samples, key=lambda s: s.value).labels


def test_metrics_have_lora_requests_info(http):
    completion_tokens(http, "a")
    info = lora_info(http)
    assert set(info) == {"max_lora", "waiting_lora_adapters", "running_lora_adapters"}
    assert info["max_lora"] == "2"


# -- in-process: no flag, flags, a bad adapter at start ---------------------------------------


def test_runtime_endpoints_do_not_exist_without_the_flag():
    from pagedserve.entrypoints.openai.app import build_app
    from pagedserve.entrypoints.openai.serving_engine import ServingContext

    ctx = ServingContext(engine=None, served_model_name="m", model_aliases={"m"},
                         model_root="m", tokenizer=None, max_model_len=64)
    app = build_app(ctx, enable_dashboard=False)

    async def post(path: str) -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post(path, json={"lora_name": "x", "lora_path": "/x"})

    try:
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            assert_error(asyncio.run(post(path)), 404, "unknown route")
    finally:
        ctx.executor.shutdown()


def test_lora_flags_parse_as_vllm():
    from pagedserve.entrypoints.cli import build_parser
    from pagedserve.entrypoints.openai.cli_args import (
        LoRAModulePath,
        parse_lora_module,
        runtime_lora_updating_allowed,
    )

    assert parse_lora_module("a=/x/y=z") == LoRAModulePath("a", "/x/y=z")
    assert parse_lora_module('{"name": "b", "path": "/p", "base_model_name": "m"}') == \
        LoRAModulePath("b", "/p", "m")
    for bad, message in (("a", "neither"), ("=/p", "empty"), ('{"name": "b"}', "strings"),
                         ('{"name": "b", "path": "/p", "rank": 8}', "unknown fields"),
                         ("{oops", "invalid JSON")):
        with pytest.raises(ValueError, match=message):
            parse_lora_module(bad)
    args = build_parser().parse_args(["serve", "--lora-modules", "a=/p", '{"name":"b","path":"/q"}',
                                      "--allow-runtime-lora-updating"])
    assert args.lora_modules == [LoRAModulePath("a", "/p"), LoRAModulePath("b", "/q")]
    assert args.allow_runtime_lora_updating
    assert runtime_lora_updating_allowed(True, {})
    for value, allowed in (("True", True), ("1", True), ("true", True), ("0", False),
                           ("no", False)):
        env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": value}
        assert runtime_lora_updating_allowed(False, env) is allowed
    assert not runtime_lora_updating_allowed(False, {})


def test_lora_flags_need_enable_lora(capsys):
    from pagedserve.entrypoints.cli import main

    for flags in (["--lora-modules", "a=/p"], ["--allow-runtime-lora-updating"]):
        assert main(["serve", "--port", str(free_port()), *flags]) == 2
        assert "needs --enable-lora" in capsys.readouterr().err


def test_a_bad_adapter_at_start_stops_the_server(server, files, capsys):
    from pagedserve.entrypoints.cli import main

    code = main(["serve", str(files["base"]), "--port", str(free_port()), "--dtype", "float32",
                 "--kv-cache-memory-bytes", str(4 << 20), "--enable-lora", "--max-lora-rank", "8",
                 "--lora-modules", f"a={files['a']}", f"big={files['big']}"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--lora-modules big:" in err and "above max_lora_rank 8" in err


def test_data_parallel_refuses_lora_requests():
    from pagedserve import LoRARequest, SamplingParams
    from pagedserve.engine.data_parallel import DataParallelLLM

    engine = object.__new__(DataParallelLLM)  # the check comes before any replica is used
    with pytest.raises(ValueError, match="data parallelism"):
        asyncio.run(engine.add_request("r", "t1", SamplingParams(),
                                       lora_request=LoRARequest("a", 1, "/p")))
