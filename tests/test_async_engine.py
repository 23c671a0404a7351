"""AsyncLLM: the engine thread, per-request streams, aborts and errors, on a fake engine."""

import asyncio
import itertools
import signal
import threading
import time

import pytest
from conftest import wait_until

from pagedserve.args import EngineArgs
from pagedserve.core.kv_cache_manager import KVCacheStats
from pagedserve.engine.async_engine import AsyncLLM
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.request_stream import (
    EngineClosedError,
    EngineStepError,
    RequestAbortedError,
)
from pagedserve.metrics import PrometheusStatLogger
from pagedserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedserve.sampling_params import SamplingParams


class FakeScheduler:
    def __init__(self, engine):
        self.engine = engine
        self.num_preemptions = 0

    @property
    def num_running(self):
        return len(self.engine.live)

    num_waiting = 0


class FakeEngine:
    """Each request emits one token ("t<i>") per step until max_tokens; a prompt "bad"
    raises ValueError; ``fail_next_step`` makes one step raise."""

    def __init__(self, step_delay=0.0):
        self.live: dict[str, list] = {}
        self.scheduler = FakeScheduler(self)
        self.step_delay = step_delay
        self.fail_next_step = False
        self.steps = 0
        self.aborted: list[str] = []
        self.thread_ids: set[int] = set()

    lora_config = None  # no LoRA adapters

    def add_request(self, rid, prompt, params, arrival_time=None, lora_request=None):
        self.thread_ids.add(threading.get_ident())
        if prompt == "bad":
            raise ValueError("prompt is bad")
        self.live[rid] = [params.max_tokens, [], RequestMetrics(arrival_time)]

    def abort_request(self, rid):
        self.thread_ids.add(threading.get_ident())
        if self.live.pop(rid, None) is not None:
            self.aborted.append(rid)

    def is_healthy(self):
        return True

    def shutdown(self):
        pass

    def has_unfinished_requests(self):
        return bool(self.live)

    def kv_cache_stats(self):
        used = len(self.live)
        return KVCacheStats(total_blocks=100, free_blocks=100 - used, used_blocks=used,
                            cached_blocks=0, block_size=16, num_tokens=used,
                            prefix_cache_queries=0, prefix_cache_hits=0)

    def spec_decoding_stats(self):
        return None  # no speculative decoding

    def step(self, on_scheduled=None):
        self.thread_ids.add(threading.get_ident())
        self.steps += 1
        if on_scheduled is not None and self.live:
            on_scheduled()
        time.sleep(self.step_delay)
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("boom")
        outs = []
        for rid, state in list(self.live.items()):
            max_tokens, tokens, metrics = state
            metrics.first_scheduled_time = metrics.first_scheduled_time or time.monotonic()
            tokens.append(len(tokens))
            done = len(tokens) >= max_tokens
            text = "".join(f"t{t}" for t in tokens)
            outs.append(RequestOutput(rid, "p", [1, 2, 3], None, [CompletionOutput(
                0, text, list(tokens), None, None, "length" if done else None)], done,
                metrics=metrics))
            if done:
                del self.live[rid]
        return outs


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


@pytest.fixture
def engine():
    fake = FakeEngine()
    stats = PrometheusStatLogger("fake", 64)
    llm = AsyncLLM(fake, stats, num_threads=1)
    llm.start()
    yield llm
    llm.shutdown()


def test_streams_outputs_in_order_and_finishes(engine):
    async def main():
        texts = [out.outputs[0].text async for out in
                 engine.generate("p", SamplingParams(max_tokens=4), "r1")]
        return texts

    texts = run(main())
    assert texts[-1] == "t0t1t2t3"
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))  # cumulative, only grows
    assert engine.engine.thread_ids == {engine._thread.ident}  # engine touched by one thread


def test_many_concurrent_requests_share_steps(engine):
    async def one(i):
        out = None
        async for out in engine.generate("p", SamplingParams(max_tokens=5), f"r{i}"):
            pass
        return out

    async def main():
        return await asyncio.gather(*(one(i) for i in range(20)))

    outs = run(main())
    assert all(o.finished and o.outputs[0].token_ids == [0, 1, 2, 3, 4] for o in outs)
    assert engine.num_steps < 20 * 5  # steps were shared, not one request at a time


def test_bad_request_fails_only_itself(engine):
    async def main():
        good = await engine.add_request("g", "p", SamplingParams(max_tokens=3))
        with pytest.raises(ValueError, match="bad"):
            await engine.add_request("b", "bad", SamplingParams(max_tokens=3))
        return [o async for o in good]

    outs = run(main())
    assert outs[-1].finished


def test_abort_by_leaving_the_stream(engine):
    fake = engine.engine
    fake.step_delay = 0.01

    async def main():
        stream = await engine.add_request("r", "p", SamplingParams(max_tokens=1000))
        async for out in stream:
            if len(out.outputs[0].token_ids) >= 2:
                break

    run(main())
    wait_until(lambda: "r" in fake.aborted, 60, "the abort to reach the engine thread")
    assert not fake.live


def test_step_failure_fails_in_flight_requests_and_loop_survives(engine):
    fake = engine.engine

    async def main():
        stream = await engine.add_request("r", "p", SamplingParams(max_tokens=1000))
        fake.fail_next_step = True
        with pytest.raises(EngineStepError):
            async for _ in stream:
                pass
        outs = [o async for o in engine.generate("p", SamplingParams(max_tokens=2), "r2")]
        return outs

    outs = run(main())
    assert outs[-1].finished and not fake.live


def test_idle_loop_sleeps(engine):
    async def main():
        async for _ in engine.generate("p", SamplingParams(max_tokens=2), "r"):
            pass

    run(main())
    steps = engine.engine.steps
    time.sleep(0.2)
    assert engine.engine.steps == steps  # no busy stepping without work


def test_shutdown_aborts_in_flight_and_refuses_new(engine):
    engine.engine.step_delay = 0.01

    async def main():
        stream = await engine.add_request("r", "p", SamplingParams(max_tokens=10_000))
        await stream.get()
        engine.abort_all("going away")
        with pytest.raises(RequestAbortedError, match="going away"):
            async for _ in stream:
                pass
        with pytest.raises(EngineClosedError):
            await engine.add_request("r2", "p", SamplingParams(max_tokens=2))

    run(main())
    engine._thread.join(5)
    assert not engine._thread.is_alive() and not engine.engine.live


def test_metrics_follow_requests(engine):
    stats = engine.stat_logger

    async def main():
        async for _ in engine.generate("p", SamplingParams(max_tokens=3), "r"):
            pass

    run(main())
    # The output reaches the stream before the engine thread records the step's stats.
    success = ('vllm:request_success_total{engine="0",finished_reason="length",'
               'model_name="fake"} 1.0')

    def rendered_with_success():
        text = stats.render().decode()
        return text if success in text else None

    text = wait_until(rendered_with_success, 60, "the finished request in the metrics")
    assert 'vllm:generation_tokens_total{engine="0",model_name="fake"} 3.0' in text
    assert 'vllm:prompt_tokens_total{engine="0",model_name="fake"} 3.0' in text
    assert 'vllm:num_requests_running{engine="0",model_name="fake"} 0.0' in text


def test_from_engine_args_builds_and_steps_on_one_thread(monkeypatch):
    """Model loading and stepping share the engine thread (one OpenMP pool; see
    ``AsyncLLM.from_engine_args``), and the caller gets the started engine back."""
    built_on = []

    def build(args):
        built_on.append(threading.get_ident())
        return FakeEngine()

    monkeypatch.setattr("pagedserve.engine.async_engine.LLMEngine", build)
    llm = AsyncLLM.from_engine_args(object())
    try:
        assert llm.is_running
        out = run(_last(llm.generate("p", SamplingParams(max_tokens=2), "r1")))
        assert out.outputs[0].text == "t0t1"
        assert built_on == [llm._thread.ident] != [threading.get_ident()]
        assert llm.engine.thread_ids == {llm._thread.ident}
    finally:
        llm.shutdown()


def test_from_engine_args_reraises_build_errors(monkeypatch):
    def build(args):
        raise FileNotFoundError("no model at /nowhere")

    monkeypatch.setattr("pagedserve.engine.async_engine.LLMEngine", build)
    with pytest.raises(FileNotFoundError, match="/nowhere"):
        AsyncLLM.from_engine_args(object())


async def _last(stream):
    out = None
    async for out in stream:
        pass
    return out


def test_interrupt_while_loading_returns_after_the_load(monkeypatch):
    """Ctrl-C during the load: KeyboardInterrupt reaches the caller only once the engine
    thread has finished loading and has ended (no thread left inside torch's C++ code)."""
    interrupted = threading.Event()
    loaded = []
    main = threading.get_ident()

    def on_sigint(signum, frame):
        interrupted.set()
        raise KeyboardInterrupt

    def build(args):  # on the engine thread: Ctrl-C arrives mid-load, the load then ends
        signal.pthread_kill(main, signal.SIGINT)
        assert interrupted.wait(30), "the main thread never took the SIGINT"
        time.sleep(0.2)  # a caller that did not wait for the load would see it unfinished
        loaded.append(True)
        return FakeEngine()

    monkeypatch.setattr("pagedserve.engine.async_engine.LLMEngine", build)
    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        with pytest.raises(KeyboardInterrupt):
            AsyncLLM.from_engine_args(object())
    finally:
        signal.signal(signal.SIGINT, previous)
    assert len(loaded) == 1  # raised after the load, not at the signal
    assert not [t for t in threading.enumerate() if t.name == "pagedserve-engine"]


def _gauge(stats: PrometheusStatLogger, name: str) -> float:
    return stats.registry.get_sample_value(name, {"model_name": "tiny", "engine": "0"})


def test_gauges_count_the_step_being_computed(tiny_llama):
    """While a (slow) step computes, its request reads as running and a queued one as
    waiting: the engine thread refreshes the gauges once the step is scheduled. A real
    engine on the tiny model, with max_num_seqs=1 and its model runner held at a gate."""
    path, _ = tiny_llama
    core = LLMEngine(EngineArgs(model=str(path), dtype="float32", device="cpu",
                                skip_tokenizer_init=True, max_num_seqs=1,
                                num_gpu_blocks_override=32, max_model_len=64))
    entered, release = threading.Event(), threading.Event()
    execute = core.executor.execute_model

    def gated_execute(sched):
        entered.set()
        assert release.wait(60), "the test never released the step"
        return execute(sched)

    core.executor.execute_model = gated_execute
    stats = PrometheusStatLogger("tiny", 64)
    llm = AsyncLLM(core, stats, num_threads=1)
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=2)
    seen = {}

    async def main():
        # Both adds are queued before the engine thread starts, so that it applies them
        # together (an add completes only between steps, and the first step will block).
        adds = [asyncio.ensure_future(llm.add_request(f"r{i}", [5, 6, 7, 8 + i], params))
                for i in range(2)]
        await asyncio.sleep(0)
        llm.start()
        streams = await asyncio.gather(*adds)
        # The first step (r0's prefill; r1 queued: max_num_seqs=1) is now held at the gate.
        assert await asyncio.to_thread(entered.wait, 60)
        seen["running"] = _gauge(stats, "vllm:num_requests_running")
        seen["waiting"] = _gauge(stats, "vllm:num_requests_waiting")
        release.set()
        return [await _last(s) for s in streams]

    try:
        outs = run(main())
    finally:
        release.set()
        llm.shutdown()
    assert seen == {"running": 1, "waiting": 1}
    assert all(o.finished and len(o.outputs[0].token_ids) == 2 for o in outs)


def test_run_between_steps(engine):
    """The function runs on the engine thread, between steps (never inside one), also on
    an idle engine; its error goes to the caller; after shutdown nothing runs."""
    fake = engine.engine
    inside_step = threading.Event()
    step = fake.step

    def marked_step(on_scheduled=None):
        inside_step.set()
        try:
            return step(on_scheduled)
        finally:
            inside_step.clear()

    fake.step = marked_step
    fake.step_delay = 0.01

    def look(eng):
        return threading.get_ident(), inside_step.is_set(), eng.steps

    def fail(eng):
        raise KeyError("nope")

    async def main():
        idle = await engine.run_between_steps(look)
        stream = await engine.add_request("r", "p", SamplingParams(max_tokens=30))
        busy = [await engine.run_between_steps(look) for _ in range(5)]
        with pytest.raises(KeyError, match="nope"):
            await engine.run_between_steps(fail)
        async for _ in stream:
            pass
        return idle, busy

    idle, busy = run(main())
    assert idle == (engine._thread.ident, False, 0)
    assert all(thread == engine._thread.ident and not inside for thread, inside, _ in busy)
    engine.shutdown()
    with pytest.raises(EngineClosedError):
        run(engine.run_between_steps(look))
