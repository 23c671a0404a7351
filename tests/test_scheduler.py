"""Scheduler: admission, token budget, chunked prefill, preemption, freeing, token stops.

No model: ``FakeModel`` samples a token for every scheduled request whose computation
reaches the end of its tokens, then calls ``update_from_output`` as the engine does.
Block size 4 throughout; assertions name exact block ids.
"""

import pytest

from pagedserve.config import CacheConfig, SchedulerConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.scheduler import Scheduler, SchedulerOutput
from pagedserve.request import Request, RequestStatus
from pagedserve.sampling_params import SamplingParams

BS = 4
EOS = 2


def make_scheduler(num_blocks=64, caching=False, **config) -> Scheduler:
    config.setdefault("max_model_len", 256)
    return Scheduler(SchedulerConfig(**config), KVCacheManager(num_blocks, BS, caching))


def make_request(rid: str, prompt_len: int, base: int = 100, **params) -> Request:
    params.setdefault("max_tokens", 16)
    prompt = list(range(base, base + prompt_len))
    return Request(rid, prompt, SamplingParams(**params), eos_token_id=EOS)


def add(sched: Scheduler, *requests: Request) -> None:
    for r in requests:
        sched.add_request(r)


class FakeModel:
    """Stands in for the model runner: one sampled token per request that reached its end
    (and, as the runner does, one for each sample forked from it in this step).

    ``script`` maps a request id to the tokens it samples, in order; otherwise request
    output ``k`` is ``1000 + k``.
    """

    def __init__(self, script: dict[str, list[int]] | None = None) -> None:
        self.script = script or {}

    def token(self, req: Request) -> int:
        tokens = self.script.get(req.request_id)
        return tokens[req.num_output_tokens] if tokens else 1000 + req.num_output_tokens

    def step(self, sched: Scheduler) -> tuple[SchedulerOutput, list[Request]]:
        out = sched.schedule()
        assert out.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
        assert len(out.requests) <= sched.config.max_num_seqs
        sampled = {}
        for req, n, table in zip(out.requests, out.num_scheduled_tokens, out.block_tables):
            end = req.num_computed_tokens + n
            assert 0 < n and end <= req.num_tokens
            assert len(table) * BS >= end  # the table covers every token computed
            if end == req.num_tokens:
                sampled[req.request_id] = [self.token(req)]
                for child in out.forks.get(req.request_id, ()):
                    sampled[child.request_id] = [self.token(child)]
        finished = sched.update_from_output(out, sampled)
        sched.kv.check_integrity()
        return out, finished


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(r.request_id, n) for r, n in zip(out.requests, out.num_scheduled_tokens)]


def tables(out: SchedulerOutput) -> dict[str, list[int]]:
    return {r.request_id: t for r, t in zip(out.requests, out.block_tables)}


def ids(requests) -> list[str]:
    return [r.request_id for r in requests]


def free_ids(sched: Scheduler) -> list[int]:
    return [b.block_id for b in sched.kv.pool.free_queue]


def run_to_completion(sched: Scheduler, model: FakeModel, max_steps: int = 200) -> int:
    for step in range(max_steps):
        if not sched.has_unfinished_requests():
            return step
        model.step(sched)
    raise AssertionError(f"not finished after {max_steps} steps")


# -- admission ----------------------------------------------------------------------------

def test_empty_schedule():
    sched = make_scheduler()
    out = sched.schedule()
    assert out.is_empty and out.total_num_scheduled_tokens == 0
    assert out.preempted_request_ids == [] and not sched.has_unfinished_requests()


def test_admission_is_fcfs_with_exact_block_tables():
    sched = make_scheduler()
    a, b, c = make_request("a", 5), make_request("b", 3), make_request("c", 9)
    add(sched, a, b, c)
    assert (sched.num_waiting, sched.num_running) == (3, 0)
    out, finished = FakeModel().step(sched)
    assert plan(out) == [("a", 5), ("b", 3), ("c", 9)]
    assert out.total_num_scheduled_tokens == 17
    assert tables(out) == {"a": [0, 1], "b": [2], "c": [3, 4, 5]}
    assert finished == []
    assert (sched.num_waiting, sched.num_running) == (0, 3)
    assert all(r.status == RequestStatus.RUNNING for r in (a, b, c))
    assert [r.num_computed_tokens for r in (a, b, c)] == [5, 3, 9]
    assert [r.output_token_ids for r in (a, b, c)] == [[1000], [1000], [1000]]


def test_decodes_are_scheduled_before_new_prefills():
    sched = make_scheduler()
    model = FakeModel()
    add(sched, make_request("a", 5), make_request("b", 3))
    model.step(sched)
    add(sched, make_request("c", 9))
    out, _ = model.step(sched)
    assert plan(out) == [("a", 1), ("b", 1), ("c", 9)]
    assert tables(out) == {"a": [0, 1], "b": [2], "c": [3, 4, 5]}


def test_max_num_seqs_and_continuous_batching():
    sched = make_scheduler(max_num_seqs=2)
    model = FakeModel()
    a = make_request("a", 5, max_tokens=2)
    b = make_request("b", 3)
    c = make_request("c", 6)
    add(sched, a, b, c)
    out, _ = model.step(sched)
    assert plan(out) == [("a", 5), ("b", 3)] and ids(sched.waiting) == ["c"]
    out, finished = model.step(sched)
    assert plan(out) == [("a", 1), ("b", 1)]
    assert finished == [a] and a.status == RequestStatus.FINISHED_LENGTH
    assert ids(sched.running) == ["b"] and ids(sched.waiting) == ["c"]
    assert free_ids(sched)[-2:] == [1, 0]  # a's blocks came back at once, tail first
    # The very next step, c takes a's place.
    out, _ = model.step(sched)
    assert plan(out) == [("b", 1), ("c", 6)]
    assert tables(out) == {"b": [2, 3], "c": [4, 5]}


# -- token budget and chunked prefill -----------------------------------------------------

def test_token_budget_splits_a_prompt_with_chunked_prefill():
    sched = make_scheduler(max_num_batched_tokens=8)
    model = FakeModel()
    a, b = make_request("a", 5), make_request("b", 6)
    add(sched, a, b)
    out, _ = model.step(sched)
    assert plan(out) == [("a", 5), ("b", 3)]
    assert tables(out) == {"a": [0, 1], "b": [2]}
    assert a.output_token_ids == [1000] and b.output_token_ids == []  # b's chunk: no token
    assert b.num_computed_tokens == 3 and b.status == RequestStatus.RUNNING
    out, _ = model.step(sched)
    assert plan(out) == [("a", 1), ("b", 3)]
    assert tables(out) == {"a": [0, 1], "b": [2, 3]}
    assert b.output_token_ids == [1000]
    out, _ = model.step(sched)
    assert plan(out) == [("a", 1), ("b", 1)]


def test_long_prompt_prefilled_over_several_steps_while_others_decode():
    sched = make_scheduler(max_num_batched_tokens=8)
    model = FakeModel()
    r, long = make_request("r", 2), make_request("long", 20, base=500)
    add(sched, r, long)
    expected = [
        ([("r", 2), ("long", 6)], {"r": [0], "long": [1, 2]}),
        ([("r", 1), ("long", 7)], {"r": [0], "long": [1, 2, 3, 4]}),
        ([("r", 1), ("long", 7)], {"r": [0], "long": [1, 2, 3, 4, 5]}),
        ([("r", 1), ("long", 1)], {"r": [0, 6], "long": [1, 2, 3, 4, 5, 7]}),
    ]
    for step, (want_plan, want_tables) in enumerate(expected):
        out, _ = model.step(sched)
        assert (plan(out), tables(out)) == (want_plan, want_tables), step
    assert r.output_token_ids == [1000 + k for k in range(4)]
    assert long.num_computed_tokens == 21 and long.output_token_ids == [1000, 1001]


def test_prompt_longer_than_budget_block_table_grows_per_chunk():
    sched = make_scheduler(max_num_batched_tokens=8)
    model = FakeModel()
    req = make_request("a", 21)
    add(sched, req)
    seen = []
    for _ in range(4):
        out, _ = model.step(sched)
        seen.append((plan(out), tables(out)["a"], req.num_computed_tokens))
    assert seen == [
        ([("a", 8)], [0, 1], 8),
        ([("a", 8)], [0, 1, 2, 3], 16),
        ([("a", 5)], [0, 1, 2, 3, 4, 5], 21),
        ([("a", 1)], [0, 1, 2, 3, 4, 5], 22),
    ]
    assert req.output_token_ids == [1000, 1001]


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    sched = make_scheduler(max_num_batched_tokens=16, max_model_len=16,
                           enable_chunked_prefill=False)
    model = FakeModel()
    add(sched, make_request("a", 10), make_request("b", 10), make_request("c", 2))
    out, _ = model.step(sched)
    # b does not fit the 6 tokens left, and c may not overtake it (FCFS).
    assert plan(out) == [("a", 10)] and ids(sched.waiting) == ["b", "c"]
    out, _ = model.step(sched)
    assert plan(out) == [("a", 1), ("b", 10), ("c", 2)]


def test_admission_stops_when_the_pool_is_short():
    sched = make_scheduler(num_blocks=3)
    add(sched, make_request("a", 8), make_request("b", 5), make_request("c", 1))
    out, _ = FakeModel().step(sched)
    # b needs 2 blocks, 1 is free; c would fit but waits behind b.
    assert plan(out) == [("a", 8)] and ids(sched.waiting) == ["b", "c"]
    assert sched.kv.block_ids("b") == [] and free_ids(sched) == [2]


# -- preemption ---------------------------------------------------------------------------

def test_preemption_of_latest_request_and_recompute_first():
    sched = make_scheduler(num_blocks=4)
    model = FakeModel()
    a = make_request("a", 7, max_tokens=3)
    b = make_request("b", 7, base=200, max_tokens=9)  # 16 tokens: fits the pool alone
    c = make_request("c", 3, base=300, max_tokens=5)
    add(sched, a, b, c)

    out, _ = model.step(sched)
    assert plan(out) == [("a", 7), ("b", 7)] and tables(out) == {"a": [0, 1], "b": [2, 3]}
    assert ids(sched.waiting) == ["c"]  # no block left for c
    out, _ = model.step(sched)
    assert plan(out) == [("a", 1), ("b", 1)] and out.preempted_request_ids == []

    # a's 9th token needs a third block: b, the latest arrival, is preempted.
    out, finished = model.step(sched)
    assert out.preempted_request_ids == ["b"]
    assert plan(out) == [("a", 1)]  # and nobody is admitted in this step
    assert tables(out) == {"a": [0, 1, 3]}  # b's blocks freed tail first: 3 before 2
    assert b.status == RequestStatus.PREEMPTED and b.num_preemptions == 1
    assert b.num_computed_tokens == 0 and b.output_token_ids == [1000, 1001]
    assert sched.kv.block_ids("b") == [] and sched.num_preemptions == 1
    assert finished == [a]  # a reached max_tokens in the same step
    assert ids(sched.waiting) == ["b", "c"]  # the preempted request goes first
    assert free_ids(sched) == [2, 3, 1, 0]

    # b comes back first and recomputes prompt + outputs (9 tokens), then c.
    out, _ = model.step(sched)
    assert plan(out) == [("b", 9), ("c", 3)]
    assert tables(out) == {"b": [2, 3, 1], "c": [0]}
    assert b.status == RequestStatus.RUNNING and b.num_computed_tokens == 9
    assert b.output_token_ids == [1000, 1001, 1002]
    run_to_completion(sched, model)
    assert b.output_token_ids == [1000 + k for k in range(9)]
    assert c.output_token_ids == [1000 + k for k in range(5)]
    assert sched.kv.pool.num_free_blocks == 4


def test_preemption_takes_latest_arrivals_and_requeues_in_arrival_order():
    sched = make_scheduler(num_blocks=4)
    model = FakeModel()
    reqs = [make_request(rid, 4, base=100 * (i + 1), max_tokens=2 if rid in "ab" else 4)
            for i, rid in enumerate("abcd")]
    a, b, _, _ = reqs
    add(sched, *reqs)
    out, _ = model.step(sched)
    assert tables(out) == {"a": [0], "b": [1], "c": [2], "d": [3]}
    # Everyone's 5th token needs a second block: a preempts d, then b preempts c.
    out, finished = model.step(sched)
    assert out.preempted_request_ids == ["d", "c"]
    assert plan(out) == [("a", 1), ("b", 1)]
    assert tables(out) == {"a": [0, 3], "b": [1, 2]}
    assert finished == [a, b]
    assert ids(sched.waiting) == ["c", "d"]
    out, _ = model.step(sched)
    assert plan(out) == [("c", 5), ("d", 5)]
    assert tables(out) == {"c": [3, 0], "d": [2, 1]}
    assert ids(sched.running) == ["c", "d"]
    assert [r.num_preemptions for r in reqs] == [0, 0, 1, 1]


def test_request_preempts_itself_when_it_is_the_latest():
    sched = make_scheduler(num_blocks=3)
    model = FakeModel()
    a = make_request("a", 7, max_tokens=5)
    b = make_request("b", 4, base=200, max_tokens=5)
    add(sched, a, b)
    model.step(sched)
    out, _ = model.step(sched)  # a still fits block 1; b's 5th token needs a block
    assert plan(out) == [("a", 1)] and out.preempted_request_ids == ["b"]
    assert ids(sched.running) == ["a"] and ids(sched.waiting) == ["b"]
    assert free_ids(sched) == [2]
    run_to_completion(sched, model)
    assert a.output_token_ids == b.output_token_ids == [1000 + k for k in range(5)]


def test_running_order_stays_arrival_order_after_readmission():
    sched = make_scheduler(num_blocks=4)
    model = FakeModel()
    a = make_request("a", 4, max_tokens=8)
    b = make_request("b", 4, base=200, max_tokens=2)
    c = make_request("c", 4, base=300, max_tokens=8)
    add(sched, a, b, c)
    model.step(sched)  # a [0], b [1], c [2]
    out, _ = model.step(sched)  # a takes 3; b preempts c; b finishes
    assert out.preempted_request_ids == ["c"] and b.is_finished
    out, _ = model.step(sched)  # c comes back behind a
    assert plan(out) == [("a", 1), ("c", 5)]
    assert ids(sched.running) == ["a", "c"]


def test_readmission_after_preemption_uses_prefix_cache():
    sched = make_scheduler(num_blocks=4, caching=True)
    model = FakeModel()
    a = make_request("a", 7, max_tokens=3)
    b = make_request("b", 7, base=200, max_tokens=9)
    c = make_request("c", 3, base=300, max_tokens=5)
    add(sched, a, b, c)
    for _ in range(3):
        out, _ = model.step(sched)
    assert out.preempted_request_ids == ["b"] and a.is_finished
    # b's first block (2) is still cached; its second (3) was handed to a and evicted.
    out, _ = model.step(sched)
    assert plan(out) == [("b", 5), ("c", 3)]
    assert tables(out) == {"b": [2, 3, 1], "c": [0]}
    assert b.num_cached_tokens == 0  # counted at first admission only
    stats = sched.kv.stats(0)
    # Queries count every lookup, as vLLM's do: c (3 tokens) was looked up in steps 1, 2
    # and 4 (step 3 preempted, so no admission was tried); b in steps 1 and 4.
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (7 + 7 + 3 + 3 + 9 + 3, 4)


# -- finishing and aborting ---------------------------------------------------------------

def test_finish_requests_from_waiting_and_running():
    sched = make_scheduler(num_blocks=8, max_num_seqs=2)
    model = FakeModel()
    a, b, c = make_request("a", 6), make_request("b", 5, base=200), make_request("c", 3)
    add(sched, a, b, c)
    model.step(sched)
    assert sched.kv.block_ids("a") == [0, 1] and sched.kv.block_ids("b") == [2, 3]

    done = sched.finish_requests(["c"], RequestStatus.FINISHED_ABORTED)
    assert done == [c] and c.status == RequestStatus.FINISHED_ABORTED
    assert c.status.finish_reason == "abort"
    assert ids(sched.waiting) == [] and "c" not in sched.requests

    done = sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert done == [a] and ids(sched.running) == ["b"]
    assert sched.kv.block_ids("a") == []
    assert free_ids(sched) == [4, 5, 6, 7, 1, 0]
    sched.kv.check_integrity()

    # Unknown and already finished ids are ignored.
    assert sched.finish_requests(["a", "c", "zzz"], RequestStatus.FINISHED_ABORTED) == []
    out, _ = model.step(sched)
    assert plan(out) == [("b", 1)]
    assert sched.finish_requests(["b"], RequestStatus.FINISHED_STOPPED) == [b]
    assert b.status.finish_reason == "stop"
    assert not sched.has_unfinished_requests()
    assert sched.kv.pool.num_free_blocks == 8
    assert all(blk.ref_cnt == 0 for blk in sched.kv.pool.blocks)
    assert sched.kv.req_blocks == {}
    assert sched.schedule().is_empty


def test_abort_of_a_preempted_request():
    sched = make_scheduler(num_blocks=3)
    model = FakeModel()
    a, b = make_request("a", 7), make_request("b", 4, base=200)
    add(sched, a, b)
    model.step(sched)
    out, _ = model.step(sched)
    assert out.preempted_request_ids == ["b"]
    assert sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED) == [b]
    assert ids(sched.waiting) == [] and sched.kv.pool.num_free_blocks == 1
    assert "b" not in sched.kv.req_hashes
    sched.kv.check_integrity()


def test_abort_in_the_middle_of_a_chunked_prefill():
    sched = make_scheduler(num_blocks=8, max_num_batched_tokens=8, caching=True)
    model = FakeModel()
    a = make_request("a", 20)
    add(sched, a)
    model.step(sched)
    assert a.num_computed_tokens == 8 and sched.kv.block_ids("a") == [0, 1]
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert sched.kv.pool.num_free_blocks == 8 and sched.kv.pool.num_cached_blocks == 2
    # Its computed blocks stay cached for the next request with the same prompt.
    again = make_request("again", 20)
    add(sched, again)
    out, _ = model.step(sched)
    assert plan(out) == [("again", 8)] and again.num_computed_tokens == 16
    assert tables(out)["again"] == [0, 1, 2, 3]


# -- n > 1: forked samples share the prompt's blocks ---------------------------------------

def test_forks_share_prompt_blocks_and_copy_on_write():
    sched = make_scheduler()
    model = FakeModel({"p": [500, 501], "c1": [600, 601], "c2": [700, 701]})
    p, c1, c2 = make_request("p", 6), make_request("c1", 6), make_request("c2", 6)
    sched.add_request(p, forks=[c1, c2])
    assert ids(sched.waiting) == ["p"]

    out, _ = model.step(sched)
    assert plan(out) == [("p", 6)] and tables(out) == {"p": [0, 1]}
    assert {k: ids(v) for k, v in out.forks.items()} == {"p": ["c1", "c2"]}
    assert out.blocks_to_copy == []
    # The samples joined with the prompt's blocks: stored once, three references each.
    assert ids(sched.running) == ["p", "c1", "c2"]
    assert [sched.kv.block_ids(r) for r in ("p", "c1", "c2")] == [[0, 1]] * 3
    assert [sched.kv.pool.blocks[i].ref_cnt for i in (0, 1)] == [3, 3]
    assert [r.num_computed_tokens for r in (p, c1, c2)] == [6, 6, 6]
    assert [r.output_token_ids for r in (p, c1, c2)] == [[500], [600], [700]]
    assert sched.kv.pool.num_free_blocks == 62

    # Each writes its own token into the shared, partly filled block 1: the first two
    # copy it (copy-on-write), the last one holds it alone and writes in place.
    out, _ = model.step(sched)
    assert plan(out) == [("p", 1), ("c1", 1), ("c2", 1)]
    assert tables(out) == {"p": [0, 2], "c1": [0, 3], "c2": [0, 1]}
    assert out.blocks_to_copy == [(1, 2), (1, 3)]
    assert [sched.kv.pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [3, 1, 1, 1]
    sched.finish_requests(["p", "c1", "c2"], RequestStatus.FINISHED_ABORTED)
    assert sched.kv.pool.num_free_blocks == 64


def test_forks_count_against_max_num_seqs():
    """A request with n = 2 takes two seats: a third request must not be admitted beside
    it when max_num_seqs is 2."""
    sched = make_scheduler(max_num_seqs=2)
    model = FakeModel()
    p, c1, q = make_request("p", 3), make_request("c1", 3), make_request("q", 3, base=300)
    sched.add_request(p, forks=[c1])
    sched.add_request(q)
    for _ in range(4):
        model.step(sched)  # FakeModel asserts len(out.requests) <= max_num_seqs
        assert sched.num_running <= 2, ids(sched.running)


def test_more_forks_than_max_num_seqs_is_rejected_or_runs():
    """n > max_num_seqs must not hang the queue: reject it, or run it to completion."""
    sched = make_scheduler(max_num_seqs=2)
    p, c1, c2 = (make_request(rid, 3, max_tokens=2) for rid in ("p", "c1", "c2"))
    try:
        sched.add_request(p, forks=[c1, c2])
    except ValueError:
        return
    run_to_completion(sched, FakeModel(), max_steps=50)


def test_abort_of_pending_forks():
    sched = make_scheduler()
    p, c1, c2 = make_request("p", 3), make_request("c1", 3), make_request("c2", 3)
    sched.add_request(p, forks=[c1, c2])
    assert sched.finish_requests(["c1"], RequestStatus.FINISHED_ABORTED) == [c1]
    assert ids(sched.pending_forks["p"]) == ["c2"]
    assert sched.finish_requests(["p", "c2"], RequestStatus.FINISHED_ABORTED) == [p, c2]
    assert sched.pending_forks == {} and not sched.has_unfinished_requests()
    assert sched.schedule().is_empty


# -- token-level stops --------------------------------------------------------------------

def _run_one(script: list[int], max_model_len: int = 256, prompt_len: int = 3, **params):
    sched = make_scheduler(max_model_len=max_model_len)
    req = make_request("r", prompt_len, **params)
    add(sched, req)
    model = FakeModel({"r": script})
    finished = []
    for _ in range(len(script)):
        _, finished = model.step(sched)
        if finished:
            break
    assert finished == [req]
    assert not sched.has_unfinished_requests() and sched.num_running == 0
    assert sched.kv.pool.num_free_blocks == 64
    return req


def test_stop_on_eos():
    req = _run_one([5, 6, EOS, 7])
    assert req.output_token_ids == [5, 6, EOS]
    assert req.status == RequestStatus.FINISHED_STOPPED
    assert req.status.finish_reason == "stop" and req.stop_reason is None


def test_stop_on_stop_token_ids():
    req = _run_one([5, 6, 7, 8], stop_token_ids=[9, 7])
    assert req.output_token_ids == [5, 6, 7]
    assert req.status == RequestStatus.FINISHED_STOPPED and req.stop_reason == 7


def test_stop_on_max_tokens():
    req = _run_one([5, 6, 7, 8, 9], max_tokens=3)
    assert req.output_token_ids == [5, 6, 7]
    assert req.status == RequestStatus.FINISHED_LENGTH
    assert req.status.finish_reason == "length" and req.stop_reason is None


def test_ignore_eos_keeps_going_until_max_tokens():
    req = _run_one([EOS, 5, EOS, 6, 7], max_tokens=4, ignore_eos=True)
    assert req.output_token_ids == [EOS, 5, EOS, 6]
    assert req.status == RequestStatus.FINISHED_LENGTH


def test_ignore_eos_still_honours_stop_token_ids():
    req = _run_one([EOS, 9, 5], max_tokens=4, ignore_eos=True, stop_token_ids=[9])
    assert req.output_token_ids == [EOS, 9] and req.stop_reason == 9


def test_min_tokens_defers_eos_and_stop_tokens():
    req = _run_one([EOS, 9, EOS, 5], max_tokens=6, min_tokens=3, stop_token_ids=[9])
    assert req.output_token_ids == [EOS, 9, EOS]
    assert req.status == RequestStatus.FINISHED_STOPPED and req.stop_reason is None


def test_min_tokens_equal_to_max_tokens():
    req = _run_one([EOS, EOS, EOS], max_tokens=2, min_tokens=2)
    assert req.output_token_ids == [EOS, EOS]
    assert req.status == RequestStatus.FINISHED_STOPPED  # EOS wins over length, as vLLM


def test_max_model_len_caps_the_sequence():
    req = _run_one([5, 6, 7, 8], max_model_len=8, prompt_len=6, max_tokens=10)
    assert req.output_token_ids == [5, 6] and req.num_tokens == 8
    assert req.status == RequestStatus.FINISHED_LENGTH


def test_request_status_lifecycle():
    assert not RequestStatus.WAITING.is_finished and not RequestStatus.PREEMPTED.is_finished
    assert [s.finish_reason for s in RequestStatus] == [
        None, None, None, "stop", "length", "abort"]


# -- bad input ----------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, field", [
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
    ({"max_model_len": 0}, "max_model_len"),
    ({"enable_chunked_prefill": False, "max_num_batched_tokens": 8, "max_model_len": 16},
     "max_num_batched_tokens"),
])
def test_scheduler_config_rejects_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**kwargs)


@pytest.mark.parametrize("block_size", [0, 2048])
def test_cache_config_rejects_bad_block_size(block_size):
    with pytest.raises(ValueError, match=r"block_size must be in \[1, 1024\]"):
        CacheConfig(block_size=block_size)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": 0}, "max_tokens must be >= 1"),
    ({"temperature": -0.1}, "temperature must be >= 0"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"min_tokens": 5, "max_tokens": 3}, "min_tokens must be <= max_tokens"),
])
def test_sampling_params_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
