"""The dashboard's engine-side data: block-state snapshots, the step timeline, the latency
window. An offline engine on the tiny random Llama; the expected values are computed
independently (from the pool's block objects, from the requests' lengths)."""

import base64

import numpy as np
import pytest

from pagedserve.args import EngineArgs
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.snapshot import CACHED, FREE, SHARED, USED, pool_state, take_snapshot
from pagedserve.engine.timeline import LatencyWindow, StepTimeline
from pagedserve.metrics import FinishedRequestStats, IterationStats
from pagedserve.sampling_params import SamplingParams

BLOCK_SIZE = 4


@pytest.fixture()
def engine(tiny_llama):
    path, _ = tiny_llama
    return LLMEngine(EngineArgs(model=str(path), dtype="float32", device="cpu",
                                skip_tokenizer_init=True, block_size=BLOCK_SIZE,
                                num_gpu_blocks_override=40, max_model_len=64,
                                max_num_batched_tokens=16))


def _expected_state(engine) -> tuple[list[int], list[int]]:
    """Block states from the pool's own block objects (ref counts, hashes), and fills from
    each request's length: the reference that ``pool_state`` must equal."""
    state = []
    for block in engine.kv_cache_manager.pool.blocks:
        if block.ref_cnt > 1:
            state.append(SHARED)
        elif block.ref_cnt == 1:
            state.append(USED)
        else:
            state.append(CACHED if block.block_hash is not None else FREE)
    filled = [BLOCK_SIZE if s == CACHED else 0 for s in state]
    for request in engine.scheduler.requests.values():
        for i, block_id in enumerate(engine.kv_cache_manager.block_ids(request.request_id)):
            fill = min(BLOCK_SIZE, max(0, request.num_computed_tokens - i * BLOCK_SIZE))
            filled[block_id] = max(filled[block_id], fill)
    return state, filled


def test_pool_state_follows_the_pool_step_by_step(engine):
    """A shared prompt prefix (prefix caching), n=2 samples (forked, shared blocks),
    a chunked prefill: after every step the arrays equal the pool's own view, the used
    count equals kv_cache_stats(), and at the end only free and cached blocks remain."""
    greedy = SamplingParams(temperature=0, ignore_eos=True, max_tokens=6)
    prefix = list(range(1, 13))
    engine.add_request("a", prefix + [20, 21], greedy)
    engine.add_request("b", list(range(30, 60)), greedy)  # 30 tokens: chunked (budget 16)
    engine.add_request("n2", prefix + [40], SamplingParams(n=2, temperature=1.0, seed=3,
                                                           ignore_eos=True, max_tokens=5))
    seen_states = set()
    while engine.has_unfinished_requests():
        engine.step()
        pool = pool_state(engine.kv_cache_manager, engine.scheduler,
                      engine.kv_cache_manager.block_tables())
        state, filled = _expected_state(engine)
        assert pool.state.tolist() == state
        assert pool.filled.tolist() == filled
        stats = engine.kv_cache_stats()
        totals = pool.totals()
        assert totals["used"] == stats.used_blocks
        # Shared blocks store their tokens once for all holders.
        assert totals["tokens"] <= stats.num_tokens
        seen_states.update(state)
    assert {USED, SHARED, CACHED} <= seen_states
    final = pool_state(engine.kv_cache_manager, engine.scheduler,
                      engine.kv_cache_manager.block_tables())
    assert set(final.state.tolist()) <= {FREE, CACHED}
    assert final.totals()["used"] == 0


def test_snapshot_wire_format(engine):
    """The JSON-ready snapshot: base64 arrays decode to pool_state's, request rows count
    what the requests hold, and the step number is the number of steps taken."""
    engine.add_request("r", list(range(1, 11)), SamplingParams(temperature=0, ignore_eos=True,
                                                                max_tokens=3))
    engine.add_request("w", list(range(30, 89)), SamplingParams(temperature=0, ignore_eos=True,
                                                                max_tokens=1))
    engine.step()
    snap = take_snapshot(engine)
    pool = pool_state(engine.kv_cache_manager, engine.scheduler,
                      engine.kv_cache_manager.block_tables())
    (wire,) = snap["pools"]
    assert np.frombuffer(base64.b64decode(wire["state"]), np.uint8).tolist() == \
        pool.state.tolist()
    assert wire["filled_dtype"] == "uint8"  # block_size 4
    assert np.frombuffer(base64.b64decode(wire["filled"]), np.uint8).tolist() == \
        pool.filled.tolist()
    assert wire["num_blocks"] == 40 and wire["block_size"] == BLOCK_SIZE
    assert snap["step"] == 1
    # r (10 tokens) and 6 of w's 59 (budget 16) were scheduled: both running, w mid-prefill.
    rows = {row["id"]: row for row in snap["running"]}
    assert rows["r"]["prompt_computed"] == 10 and rows["r"]["output_tokens"] == 1
    assert rows["w"]["prompt_computed"] == 6 and rows["w"]["output_tokens"] == 0
    assert len(rows["r"]["blocks"]) == 3 and len(rows["w"]["blocks"]) == 2
    assert snap["kv_cache_stats"]["used_blocks"] == 5 == wire["totals"]["used"]
    assert snap["steps"]["step"] == [1]


def test_timeline_splits_prefill_and_decode(engine):
    """No prefix caching hits, no preemption: every prompt token is prefill once, and each
    output token but the last is decoded once."""
    engine.kv_cache_manager.enable_caching = False
    prompts = [list(range(1, 6)), list(range(10, 30))]
    max_tokens = 4
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, ignore_eos=True,
                                                     max_tokens=max_tokens))
    while engine.has_unfinished_requests():
        engine.step()
    cols = engine.timeline.columns()
    assert sum(cols["prefill_tokens"]) == sum(len(p) for p in prompts)
    assert sum(cols["decode_tokens"]) == len(prompts) * (max_tokens - 1)
    assert cols["step"] == list(range(1, engine.timeline.num_steps + 1))
    assert cols["used_blocks"][-1] == 0 and cols["num_running"][-1] == 0


def test_timeline_keeps_the_last_steps():
    timeline = StepTimeline(maxlen=2)
    sched = type("S", (), {"requests": [], "num_scheduled_tokens": [], "preempted_request_ids": [],
                           "total_num_scheduled_tokens": 0})()
    pool = type("P", (), {"num_blocks": 8, "num_free_blocks": 8})()
    scheduler = type("Sch", (), {"kv": type("K", (), {"pool": pool})(), "num_running": 0,
                                 "num_waiting": 0})()
    for _ in range(3):
        timeline.end(timeline.begin(sched, 0.0), scheduler)
    assert timeline.num_steps == 3
    assert timeline.columns()["step"] == [2, 3]
    with pytest.raises(ValueError, match="maxlen"):
        StepTimeline(maxlen=0)


def test_latency_window_slides():
    now = [1000.0]
    window = LatencyWindow(seconds=60, clock=lambda: now[0])
    window.record(None, IterationStats(time_to_first_tokens=[9.0]))
    now[0] += 30
    window.record(None, IterationStats(
        time_to_first_tokens=[float(v) for v in range(1, 101)],
        inter_token_latencies=[0.5],
        finished_requests=[FinishedRequestStats("stop", 2.0, 3, 4, 4)]))
    now[0] += 31  # the first TTFT (9.0) is now 61 s old
    p = window.percentiles()
    assert p["ttft"]["count"] == 100
    assert p["ttft"]["p50"] == pytest.approx(50.5)  # median of 1..100
    assert p["tpot"] == {"count": 1, "p50": 0.5, "p90": 0.5, "p99": 0.5}
    assert p["e2e"]["p99"] == 2.0
    now[0] += 60
    assert window.percentiles()["ttft"] == {"count": 0, "p50": None, "p90": None, "p99": None}
