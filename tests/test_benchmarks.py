"""Benchmark commands (issue 6): behaviour only, never timing.

- Dataset loaders parse each shared data file: request counts, prompt and output lengths.
- ``bench throughput`` on a tiny random Llama runs with both schedulings; static batching
  never admits a request while its batch runs (checked by stepping the engine and on the
  scheduler alone), and takes exactly sum(longest output of each batch) steps.
- ``bench serve`` metrics (TTFT, TPOT, ITL, E2EL) on hand-made timestamps; the client
  end to end against a tiny fake SSE server.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest
import torch
import transformers

from pagedserve.args import EngineArgs
from pagedserve.benchmarks import datasets, serve, throughput
from pagedserve.config import SchedulerConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.scheduler import Scheduler
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.entrypoints import cli
from pagedserve.model_loader.files import resolve_model_path
from pagedserve.request import Request
from pagedserve.sampling_params import SamplingParams
from pagedserve.tokenizer import load_tokenizer

DATA = datasets.DEFAULT_DATA_DIR
needs_data = pytest.mark.skipif(not (DATA / "smollm2_workload_64.jsonl").is_file(),
                                reason=f"shared data folder {DATA} not present")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_path(None))


def dataset_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    datasets.add_dataset_args(parser)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


# -- datasets ---------------------------------------------------------------------------


def test_random_lengths_and_ids(tokenizer):
    args = dataset_args("--num-prompts", "50", "--input-len", "20", "--output-len", "10",
                        "--range-ratio", "0.5")
    samples = datasets.get_samples(args, tokenizer)
    assert len(samples) == 50
    assert all(10 <= s.prompt_len <= 30 and 5 <= s.expected_output_len <= 15 for s in samples)
    assert len({s.prompt_len for s in samples}) > 1  # the range is used
    special = set(tokenizer.all_special_ids)
    assert all(0 <= t < len(tokenizer) and t not in special
               for s in samples for t in s.prompt_token_ids)
    again = datasets.get_samples(args, tokenizer)
    assert [s.prompt_token_ids for s in again] == [s.prompt_token_ids for s in samples]
    fixed = datasets.get_samples(dataset_args("--num-prompts", "3", "--input-len", "7"),
                                 tokenizer)
    assert [(s.prompt_len, s.expected_output_len) for s in fixed] == [(7, 128)] * 3
    with pytest.raises(ValueError, match="range_ratio"):
        datasets.get_samples(dataset_args("--range-ratio", "1.5"), tokenizer)


@needs_data
def test_workload_file():
    samples = datasets.get_samples(dataset_args("--dataset-name", "workload"))
    with open(DATA / "smollm2_workload_64.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert len(samples) == 64
    assert [s.prompt_token_ids for s in samples] == [r["prompt_token_ids"] for r in records]
    assert sum(s.expected_output_len for s in samples) == 9145
    first = datasets.get_samples(dataset_args("--dataset-name", "workload", "--num-prompts", "5"))
    assert [s.expected_output_len for s in first] == [r["max_tokens"] for r in records[:5]]
    capped = datasets.get_samples(dataset_args("--dataset-name", "workload",
                                               "--max-output-len", "20"))
    assert max(s.expected_output_len for s in capped) == 20


def _is_chat(tokenizer, ids: list[int]) -> bool:
    text = tokenizer.decode(ids)
    return text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")


@needs_data
def test_mt_bench_lengths_from_gpt4o_answers(tokenizer):
    one = datasets.get_samples(dataset_args("--dataset-name", "mt-bench"), tokenizer)
    two = datasets.get_samples(dataset_args("--dataset-name", "mt-bench",
                                            "--mt-bench-turns", "2"), tokenizer)
    assert (len(one), len(two)) == (80, 160)
    with open(DATA / "mt_bench_question.jsonl") as f:
        q81 = json.loads(f.readline())
    with open(DATA / "mt_bench_model_answer_gpt-4o.jsonl") as f:
        answers = {a["question_id"]: a for a in map(json.loads, f)}
    turns = answers[q81["question_id"]]["choices"][0]["turns"]
    # File order: question 81's first turn, then (two turns) its follow-up.
    assert one[0].expected_output_len == len(tokenizer.encode(turns[0],
                                                              add_special_tokens=False))
    assert two[1].expected_output_len == len(tokenizer.encode(turns[1],
                                                              add_special_tokens=False))
    assert q81["turns"][0] in tokenizer.decode(one[0].prompt_token_ids)
    assert turns[0] in tokenizer.decode(two[1].prompt_token_ids)  # the history is there
    assert all(_is_chat(tokenizer, s.prompt_token_ids) for s in two[:4])


@needs_data
def test_alpaca_eval_and_sharegpt(tokenizer):
    alpaca = datasets.get_samples(dataset_args("--dataset-name", "alpaca-eval"), tokenizer)
    assert len(alpaca) == 805
    with open(DATA / "alpaca_eval_gpt4_1106_preview_model_outputs.json") as f:
        first = json.load(f)[0]
    assert alpaca[0].expected_output_len == len(tokenizer.encode(first["output"],
                                                                 add_special_tokens=False))
    assert _is_chat(tokenizer, alpaca[0].prompt_token_ids)

    share = datasets.get_samples(dataset_args("--dataset-name", "sharegpt",
                                              "--output-len", "33"), tokenizer)
    assert len(share) == 500  # no replies in this file: --output-len is every length
    assert {s.expected_output_len for s in share} == {33}
    assert _is_chat(tokenizer, share[0].prompt_token_ids)
    some = datasets.get_samples(dataset_args("--dataset-name", "sharegpt", "--num-prompts",
                                             "10", "--output-len", "33"), tokenizer)
    assert len(some) == 10 and len({tuple(s.prompt_token_ids) for s in some}) == 10


# The copy-edit set (issue 29): prompts whose answers copy from them. At least 20, as many
# quotes as code edits, every paragraph to quote and file to edit >= 128 tokens and present
# in the chat-templated prompt; output length 192 unless --output-len says otherwise.


def test_copy_edit_prompts_hold_long_copyable_sources(tokenizer):
    prompts = datasets.copy_edit_prompts()
    kinds = [p["kind"] for p in prompts]
    assert len(prompts) >= 20
    assert kinds.count("quote") == kinds.count("code") == len(prompts) // 2
    sources = [p["source"] for p in prompts]
    lengths = [len(ids) for ids in tokenizer(sources, add_special_tokens=False)["input_ids"]]
    assert min(lengths) >= 128, lengths
    for p in prompts:
        assert p["source"] in p["prompt"]


def test_copy_edit_samples_are_chats_with_output_len(tokenizer):
    prompts = datasets.copy_edit_prompts()
    samples = datasets.get_samples(dataset_args("--dataset-name", "copy-edit"), tokenizer)
    assert len(samples) == len(prompts)
    assert {s.expected_output_len for s in samples} == {192}
    for prompt, sample in zip(prompts, samples):
        assert prompt["source"] in tokenizer.decode(sample.prompt_token_ids)
    longer = datasets.get_samples(dataset_args("--dataset-name", "copy-edit", "--output-len", "300",
                                               "--num-prompts", "4"),
                                  tokenizer)
    assert len(longer) == 4 and {s.expected_output_len for s in longer} == {300}


def test_copy_edit_needs_a_tokenizer():
    assert datasets.needs_tokenizer("copy-edit")
    with pytest.raises(ValueError, match="tokenizer"):
        datasets.get_samples(dataset_args("--dataset-name", "copy-edit"))


def test_sharegpt_reply_sets_output_len(tokenizer, tmp_path):
    conv = [{"id": "a", "conversations": [{"from": "human", "value": "Say hi."},
                                          {"from": "gpt", "value": "Hi there, friend!"}]},
            {"id": "b", "conversations": [{"from": "human", "value": "Count to three."}]}]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(conv))
    samples = datasets.get_samples(dataset_args("--dataset-name", "sharegpt", "--dataset-path",
                                                str(path), "--output-len", "9"), tokenizer)
    reply = len(tokenizer.encode("Hi there, friend!", add_special_tokens=False))
    assert [s.expected_output_len for s in samples] == [reply, 9]
    too_long = datasets.get_samples(dataset_args("--dataset-name", "sharegpt", "--dataset-path",
                                                 str(path), "--output-len", "9",
                                                 "--num-prompts", "5"), tokenizer,
                                    max_model_len=samples[1].prompt_len + 9)
    assert len(too_long) == 5  # the set is repeated to make 5
    with pytest.raises(FileNotFoundError, match="--dataset-path"):
        datasets.get_samples(dataset_args("--dataset-name", "sharegpt", "--dataset-path",
                                          str(tmp_path / "missing.json")), tokenizer)


# -- static vs continuous scheduling ----------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, tokenizer):
    """A random 2-layer Llama (vocab 256) with the bundled model's tokenizer."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    path = tmp_path_factory.mktemp("tiny_llama")
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: extra threads only spin on a busy machine
    yield
    torch.set_num_threads(before)


TINY = ["--dtype", "float32", "--num-gpu-blocks-override", "64", "--max-model-len", "64",
        "--max-num-batched-tokens", "128", "--disable-tqdm"]


@pytest.mark.parametrize("scheduling", ["continuous", "static"])
def test_bench_throughput_command(tiny_model, tmp_path, capsys, scheduling):
    out = tmp_path / "tp.json"
    rc = cli.main(["bench", "throughput", str(tiny_model), "--dataset-name", "random",
                   "--num-prompts", "6", "--input-len", "8", "--output-len", "6",
                   "--range-ratio", "0.5", "--max-num-seqs", "2", "--scheduling", scheduling,
                   "--output-json", str(out), *TINY])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "requests/s" in printed and "output tokens/s" in printed
    data = json.loads(out.read_text())
    r = data["result"]
    assert r["scheduling"] == scheduling
    assert r["num_requests"] == 6
    assert r["output_tokens"] == r["expected_output_tokens"] == data["dataset"]["output_tokens"]
    samples = datasets.get_samples(dataset_args("--num-prompts", "6", "--input-len", "8",
                                                "--output-len", "6", "--range-ratio", "0.5"),
                                   vocab_size=256)
    lens = [s.expected_output_len for s in samples]
    assert len(set(lens)) > 1
    if scheduling == "static":
        # Batches of 2 in arrival order; each runs (prompt + first token, then decode
        # steps) until its longest request ends: that many steps, no more, no less.
        assert r["num_steps"] == sum(max(lens[i:i + 2]) for i in range(0, 6, 2))
    else:
        assert r["num_steps"] < sum(max(lens[i:i + 2]) for i in range(0, 6, 2))


class _RecordingBar:
    """Stands in for tqdm: keeps the total and every update."""

    made: ClassVar[list[_RecordingBar]] = []

    def __init__(self, total, **kwargs):
        self.total, self.kwargs, self.updates = total, kwargs, []
        self.made.append(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n):
        self.updates.append(n)


def test_bench_throughput_progress_counts_output_tokens(tiny_model, tmp_path, monkeypatch):
    """The bar's unit is the output token: it moves on every step that samples (one token
    per running request) instead of waiting for the requests, which all end together."""
    monkeypatch.setattr(throughput, "tqdm", _RecordingBar)
    _RecordingBar.made.clear()
    out = tmp_path / "tp.json"
    argv = ["bench", "throughput", str(tiny_model), "--dataset-name", "random",
            "--num-prompts", "6", "--input-len", "8", "--output-len", "6", "--range-ratio",
            "0.5", "--max-num-seqs", "2", "--output-json", str(out), *TINY]
    assert cli.main([a for a in argv if a != "--disable-tqdm"]) == 0
    r = json.loads(out.read_text())["result"]
    (bar,) = _RecordingBar.made
    assert (bar.total, bar.kwargs["unit"], bar.kwargs["disable"]) == (
        r["expected_output_tokens"], "tok", False)
    assert sum(bar.updates) == r["output_tokens"] == r["expected_output_tokens"]
    assert len(bar.updates) == r["num_steps"]  # every step here samples (no chunked prefill)
    assert bar.updates[:2] == [2, 2]  # two requests running from the first step


def test_bench_throughput_timeline(tiny_model, tmp_path, capsys):
    """--timeline writes every step: the HTML page's data counts each prompt token once as
    prefill and each output token but the first once as decode (prompts shorter than a
    block: no prefix-cache hit); the PNG is a PNG; another suffix fails before the run."""
    args = ["bench", "throughput", str(tiny_model), "--dataset-name", "random",
            "--num-prompts", "4", "--input-len", "8", "--output-len", "5", "--max-num-seqs",
            "2", "--output-json", str(tmp_path / "tp.json"), *TINY]
    page = tmp_path / "timeline.html"
    assert cli.main([*args, "--timeline", str(page)]) == 0
    result = json.loads((tmp_path / "tp.json").read_text())["result"]
    text = page.read_text()
    data = json.loads(text[text.index("const d = ") + 10:text.index(";\nconst bars")])
    assert data["step"] == list(range(1, result["num_steps"] + 1))
    assert sum(data["prefill_tokens"]) == result["prompt_tokens"]
    assert sum(data["decode_tokens"]) == result["output_tokens"] - result["num_requests"]
    assert data["used_blocks"][-1] == 0
    assert "<script src" not in text and "<link" not in text  # uPlot inlined: no fetch
    png = tmp_path / "timeline.png"
    assert cli.main([*args, "--timeline", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    assert cli.main([*args, "--timeline", str(tmp_path / "t.svg")]) == 2
    assert "--timeline must name a .html or .png file" in capsys.readouterr().err


def test_bench_latency_command_and_flop_count(tiny_model, tmp_path, capsys):
    out = tmp_path / "lat.json"
    rc = cli.main(["bench", "latency", str(tiny_model), "--batch-size", "3", "--input-len", "5",
                   "--output-len", "4", "--num-iters-warmup", "1", "--num-iters", "2",
                   "--output-json", str(out), *TINY])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "50% percentile latency" in printed and "GEMM rate (torch.mm 2048^3, float32)" in printed
    r = json.loads(out.read_text())
    assert len(r["latencies"]) == 2
    # The tiny model by hand (hidden 64, intermediate 96, 4 heads x 16, 2 KV heads, 2 layers,
    # vocab 256): q 64x64, k and v 64x32 each, o 64x64, gate/up 64x96 each, down 96x64.
    linear = 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 96)
    tokens = 5 + 4 - 1  # each request feeds its prompt and all outputs but the last
    attention = 4 * 4 * 16 * 2 * sum(range(1, tokens + 1))
    lm_head = 2 * 64 * 256 * 4
    flops = 3 * (2 * linear * tokens + attention + lm_head)
    assert r["achieved_gflops"] == pytest.approx(flops / r["percentiles"]["50"] / 1e9)
    assert r["gemm_gflops"] > 0


def _trace_admissions(engine: LLMEngine) -> list[tuple[set[str], set[str], set[str]]]:
    """Wrap the scheduler: per step, (running before, admitted, finished so far)."""
    sched = engine.scheduler
    original = sched.schedule
    trace = []
    seen: set[str] = set()

    def schedule():
        before = {r.request_id for r in sched.running}
        out = original()
        admitted = {r.request_id for r in out.requests} - before - seen
        seen.update(admitted)
        trace.append((before, admitted, seen - set(sched.requests)))
        return out

    sched.schedule = schedule
    return trace


@pytest.mark.parametrize("scheduling", ["static", "continuous"])
def test_static_never_admits_while_running(tiny_model, scheduling):
    engine = LLMEngine(EngineArgs(model=str(tiny_model), dtype="float32", max_num_seqs=3,
                                  num_gpu_blocks_override=64, max_model_len=64,
                                  max_num_batched_tokens=128, scheduling=scheduling))
    trace = _trace_admissions(engine)
    out_lens = [5, 1, 3, 4, 2, 6, 2]
    for i, n in enumerate(out_lens):
        engine.add_request(str(i), {"prompt_token_ids": [10 + i, 20, 30, 40 + i]},
                           SamplingParams(temperature=0, ignore_eos=True, max_tokens=n))
    outputs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outputs[o.request_id] = len(o.outputs[0].token_ids)
    assert outputs == {str(i): n for i, n in enumerate(out_lens)}
    admitting = [(before, admitted) for before, admitted, _ in trace if admitted]
    if scheduling == "continuous":
        assert any(before for before, _ in admitting)  # joins a running batch
        return
    assert all(not before for before, _ in admitting)
    assert [admitted for _, admitted in admitting] == [{"0", "1", "2"}, {"3", "4", "5"}, {"6"}]
    assert len(trace) == 5 + 6 + 2  # each batch lasts as long as its longest request


class _FakeRunner:
    """One token per request whose computation reaches its end, as the model runner does."""

    @staticmethod
    def step(sched: Scheduler):
        out = sched.schedule()
        sampled = {r.request_id: [1000] for r, n in zip(out.requests, out.num_scheduled_tokens)
                   if r.num_computed_tokens + n == r.num_tokens}
        sched.update_from_output(out, sampled)
        return out


def test_static_batch_forms_over_several_steps_then_closes():
    """A 10-token budget and 8-token prompts: a batch of 3 takes 2 steps of chunked
    prefill to form; nobody else joins it, not even when its first request has finished."""
    config = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=10, max_model_len=64,
                             scheduling="static")
    sched = Scheduler(config, KVCacheManager(64, 4, False))
    lens = [3, 4, 4, 2, 2, 2]
    for i, n in enumerate(lens):
        sched.add_request(Request(f"r{i}", list(range(100 + i, 108 + i)),
                                  SamplingParams(max_tokens=n, ignore_eos=True), 2))
    admitted_at: dict[str, int] = {}
    finished_at: dict[str, int] = {}
    step = 0
    while sched.has_unfinished_requests():
        live = set(sched.requests)
        out = _FakeRunner.step(sched)
        for r in out.requests:
            admitted_at.setdefault(r.request_id, step)
        for rid in live - set(sched.requests):
            finished_at[rid] = step
        step += 1
    first, second = ["r0", "r1", "r2"], ["r3", "r4", "r5"]
    assert [admitted_at[r] for r in first] == [0, 0, 1]  # r1, r2 prefill in chunks
    assert finished_at["r0"] == 2 < min(finished_at[r] for r in first[1:])
    assert min(admitted_at[r] for r in second) > max(finished_at[r] for r in first)
    assert sched.kv.pool.num_free_blocks == 64


def test_scheduling_is_validated():
    with pytest.raises(ValueError, match="scheduling"):
        SchedulerConfig(scheduling="batch")


# -- bench serve ------------------------------------------------------------------------


def test_serve_metrics_by_hand():
    R = serve.RequestResult
    results = [
        R(10, 3, start=0.0, chunk_times=[0.5, 0.6, 0.8], end=0.8, output_tokens=3,
          success=True),
        # 4 tokens in 2 chunks (the second carries 3): TPOT uses tokens, ITL uses chunks.
        R(20, 4, start=1.0, chunk_times=[1.2, 1.6], end=1.7, output_tokens=4, success=True),
        R(30, 1, start=0.2, chunk_times=[0.3], end=0.3, output_tokens=1, success=True),
        R(40, 5, start=0.1, error="HTTP 500", success=False),
    ]
    m = serve.compute_metrics(results, duration=2.0)
    assert (m["completed"], m["failed"]) == (3, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (60, 8)
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(4.0)
    assert m["total_token_throughput"] == pytest.approx(34.0)
    assert m["max_concurrent_requests"] == 2
    expected = {
        # TTFT 500, 200, 100 ms; p99 by linear interpolation: 200 + 0.98 * 300
        "ttft": (800 / 3, 200, 494),
        # TPOT (0.8 - 0.5) / 2 = 150 ms and (1.6 - 1.2) / 3 = 133.3 ms; none for 1 token
        "tpot": ((150 + 400 / 3) / 2, (150 + 400 / 3) / 2, 150 - 0.01 * (150 - 400 / 3)),
        # ITL 100, 200, 400 ms; p99 = 200 + 0.98 * 200
        "itl": (700 / 3, 200, 396),
        # E2EL 800, 700, 100 ms
        "e2el": (1600 / 3, 700, 700 + 0.98 * 100),
    }
    for name, (mean, median, p99) in expected.items():
        assert m[f"mean_{name}_ms"] == pytest.approx(mean), name
        assert m[f"median_{name}_ms"] == pytest.approx(median), name
        assert m[f"p99_{name}_ms"] == pytest.approx(p99), name


def test_arrival_offsets():
    assert serve.arrival_offsets(5, float("inf"), 1.0, 0) == [0.0] * 5
    offsets = serve.arrival_offsets(4000, 4.0, 1.0, seed=3)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    assert offsets[-1] / 3999 == pytest.approx(0.25, rel=0.05)  # mean gap 1 / rate
    assert offsets == serve.arrival_offsets(4000, 4.0, 1.0, seed=3)
    with pytest.raises(ValueError, match="request_rate"):
        serve.arrival_offsets(3, 0.0, 1.0, 0)


class _FakeOpenAI(BaseHTTPRequestHandler):
    """``GET /v1/models`` and a streaming ``POST /v1/completions``: one chunk per token
    ("t"), a usage chunk, ``[DONE]``. Records the request bodies."""

    bodies: ClassVar[list[dict]] = []

    def log_message(self, *args) -> None:
        pass

    def _send(self, payload: bytes, content_type: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self) -> None:
        self._send(json.dumps({"object": "list", "data": [{"id": "fake-model"}]}).encode(),
                   "application/json")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = body["max_tokens"]
        for i in range(n):
            time.sleep(0.002)
            choice = {"index": 0, "text": "t", "finish_reason": "length" if i == n - 1 else None}
            self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            self.wfile.flush()
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
        self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def fake_server():
    _FakeOpenAI.bodies = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeOpenAI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@needs_data
def test_bench_serve_against_fake_server(fake_server, tmp_path, capsys):
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    argv = ["bench", "serve", "--base-url", fake_server, "--dataset-name", "workload",
            "--num-prompts", "6", "--max-output-len", "5", "--request-rate", "200",
            "--max-concurrency", "2", "--output-json", str(out), "--disable-tqdm"]
    plotting = True
    try:
        import matplotlib  # noqa: F401
        argv += ["--plot", str(png)]
    except ImportError:
        plotting = False
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    for label in ("Mean TTFT (ms)", "Median TPOT (ms)", "P99 ITL (ms)", "Mean E2EL (ms)",
                  "Request throughput (req/s)", "Output token throughput (tok/s)"):
        assert label in printed
    data = json.loads(out.read_text())
    m = data["metrics"]
    assert data["model"] == "fake-model"
    assert (m["completed"], m["failed"]) == (6, 0)
    assert m["total_output_tokens"] == data["dataset"]["output_tokens"]
    assert 1 <= m["max_concurrent_requests"] <= 2
    bodies = _FakeOpenAI.bodies[1:]  # after the warm-up request
    assert len(bodies) == 6
    assert all(b["stream"] and b["ignore_eos"] and b["temperature"] == 0 for b in bodies)
    assert all(isinstance(b["prompt"], list) for b in bodies)  # token ids
    if plotting:
        assert png.stat().st_size > 0
