"""Property test of the core: random interleavings of add, step and abort (hypothesis).

A fake model drives the scheduler and keeps a *shadow KV cache*: every scheduled token is
written to the slot its block table gives it (after the step's copy-on-write copies), and
every token a request attends to must read back as that request's own token. This catches
a prefix-cache hit on the wrong block, a block re-used while still referenced, a shared
block written without a copy, or a table that does not cover its tokens.

After every operation: the pool's invariants (``check_integrity``: free + used == total,
ref counts == number of tables holding each block), no block in two tables unless it is a
cached full block of a prefix both share or the prompt blocks of samples forked from one
request (n > 1), tables exactly as long as the computed tokens need, every request in
exactly one place. At the end (drain by steps only, or abort everything): every block
free with ref count 0, no per-request state left, no request lost, no deadlock.
"""

from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from pagedserve.config import SchedulerConfig
from pagedserve.core.kv_cache_manager import KVCacheManager, cdiv
from pagedserve.core.scheduler import Scheduler
from pagedserve.request import Request, RequestStatus
from pagedserve.sampling_params import SamplingParams

EOS = 2
MAX_PROMPT = 60
MAX_OUTPUT = 12
MAX_LEN = MAX_PROMPT + MAX_OUTPUT
# Shared prefixes (system prompts): requests draw a prefix of one of these.
PREFIXES = [[10_000 * (p + 1) + j for j in range(MAX_PROMPT)] for p in range(2)]


class World:
    """The scheduler under test, a fake model runner with a shadow KV cache
    (slot -> token id), and the test's own record of every request."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.kv = sched.kv
        self.bs = sched.kv.block_size
        self.slots: dict[int, int] = {}
        self.added: list[Request] = []
        self.family: dict[str, str] = {}  # request id -> id of the request it forked from
        self.members: dict[str, list[Request]] = {}  # family id -> its samples
        self.salt: dict[str, int] = {}  # sample index: forks sample different tokens
        self.eos_at: dict[str, int] = {}  # request id -> output index that samples EOS
        self.aborted: set[str] = set()
        self.max_sharing = 0  # most tables seen holding one block (statistics only)

    # -- driving --------------------------------------------------------------------------

    def add(self, prompt: list[int], max_tokens: int, n: int, eos: int | None) -> None:
        fid = f"r{len(self.members)}"
        samples = [
            Request(fid if k == 0 else f"{fid}.{k}", prompt,
                    SamplingParams(max_tokens=max_tokens), eos_token_id=EOS)
            for k in range(n)
        ]
        for k, r in enumerate(samples):
            self.family[r.request_id] = fid
            self.salt[r.request_id] = k
            if eos is not None:
                self.eos_at[r.request_id] = eos + k  # siblings stop at different points
        self.members[fid] = samples
        self.added.extend(samples)
        self.sched.add_request(samples[0], forks=samples[1:])

    def abort(self, index: int, whole_family: bool) -> None:
        """Abort a request with all its samples (the engine's abort), or finish one sample
        alone (the engine's stop-string path; only for a sample not waiting to fork)."""
        req = self.added[index % len(self.added)]
        pending = {r.request_id for fs in self.sched.pending_forks.values() for r in fs}
        alone = not whole_family and req.request_id not in pending and (
            req.request_id not in self.sched.pending_forks)
        targets = [req] if alone else self.members[self.family[req.request_id]]
        live = [r for r in targets if not r.is_finished]
        done = self.sched.finish_requests([r.request_id for r in targets],
                                          RequestStatus.FINISHED_ABORTED)
        assert done == live
        for r in done:
            assert r.status == RequestStatus.FINISHED_ABORTED
            assert self.kv.block_ids(r.request_id) == []
            self.aborted.add(r.request_id)

    def sample(self, req: Request) -> int:
        if req.num_output_tokens + 1 == self.eos_at.get(req.request_id):
            return EOS
        # Content-determined: equal prompts give equal outputs (duplicate full blocks);
        # forked samples of one prompt differ by their salt.
        return 5000 + (sum(req.all_token_ids[-3:]) + 7 * self.salt[req.request_id]) % 97

    def slot(self, table: list[int], pos: int) -> int:
        return table[pos // self.bs] * self.bs + pos % self.bs

    def step(self) -> None:
        sched, cfg = self.sched, self.sched.config
        had_work = sched.has_unfinished_requests()
        out = sched.schedule()
        assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(out.requests) <= cfg.max_num_seqs
        assert len({r.request_id for r in out.requests}) == len(out.requests)
        assert not set(out.preempted_request_ids) & {r.request_id for r in out.requests}
        if had_work and out.is_empty:
            assert out.preempted_request_ids, "nothing scheduled and nothing preempted: stuck"
        for src, dst in out.blocks_to_copy:  # copy-on-write, before the forward pass
            for off in range(self.bs):
                if src * self.bs + off in self.slots:
                    self.slots[dst * self.bs + off] = self.slots[src * self.bs + off]
        work = list(zip(out.requests, out.num_scheduled_tokens, out.block_tables))
        for req, n, table in work:  # every layer writes its new K/V first ...
            assert req.status == RequestStatus.RUNNING
            assert table == self.kv.block_ids(req.request_id)
            start = req.num_computed_tokens
            assert n > 0 and start + n <= req.num_tokens
            assert len(table) == cdiv(start + n, self.bs)
            for pos in range(start, start + n):
                self.slots[self.slot(table, pos)] = req.all_token_ids[pos]
        sampled = {}
        for req, n, table in work:  # ... then attends to everything up to its new tokens
            end = req.num_computed_tokens + n
            for pos in range(end):
                assert self.slots.get(self.slot(table, pos)) == req.all_token_ids[pos], (
                    f"{req.request_id} reads a wrong token at position {pos}")
            if end == req.num_tokens:
                sampled[req.request_id] = [self.sample(req)]
                for child in out.forks.get(req.request_id, ()):
                    sampled[child.request_id] = [self.sample(child)]
        for rid in out.forks:
            assert rid in sampled, "forks announced for a prompt that did not complete"
        finished = sched.update_from_output(out, sampled)
        for req in finished:
            assert req.is_finished and self.kv.block_ids(req.request_id) == []

    # -- invariants -----------------------------------------------------------------------

    def check(self) -> None:
        sched, kv, bs = self.sched, self.kv, self.bs
        kv.check_integrity()
        stats = kv.stats(0)
        assert stats.free_blocks + stats.used_blocks == stats.total_blocks

        # Every live request is in exactly one place: running, waiting or about to fork.
        running = [r.request_id for r in sched.running]
        waiting = [r.request_id for r in sched.waiting]
        pending = [r.request_id for fs in sched.pending_forks.values() for r in fs]
        places = running + waiting + pending
        assert len(set(places)) == len(places) and set(places) == set(sched.requests)
        assert sched.num_running <= sched.config.max_num_seqs
        arrival = [sched._arrival[rid] for rid in running]
        assert arrival == sorted(arrival), "running list out of arrival order"
        for rid in waiting + pending:
            req = sched.requests[rid]
            assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert req.num_computed_tokens == 0 and kv.block_ids(rid) == []
        assert set(kv.req_blocks) <= set(running)

        # Running requests hold exactly the blocks their computed tokens need, intact.
        holders: dict[int, list[tuple[Request, int]]] = {}
        for req in sched.running:
            table = kv.block_ids(req.request_id)
            assert req.status == RequestStatus.RUNNING
            assert len(table) == cdiv(req.num_computed_tokens, bs)
            assert req.num_computed_tokens < req.num_tokens  # a sampled token is pending
            for pos in range(req.num_computed_tokens):
                assert self.slots.get(self.slot(table, pos)) == req.all_token_ids[pos]
            for i, block_id in enumerate(table):
                holders.setdefault(block_id, []).append((req, i))
        self.max_sharing = max([self.max_sharing, *map(len, holders.values())])

        # A block in several tables: same logical index, same computed contents, and
        # either a cached full block or a block of samples forked from one request.
        for block_id, held in holders.items():
            if len(held) == 1:
                continue
            i = held[0][1]
            assert all(j == i for _, j in held), f"block {block_id} at several indexes"
            filled = {min(max(r.num_computed_tokens - i * bs, 0), bs) for r, _ in held}
            assert len(filled) == 1, f"block {block_id} written by one holder only"
            (filled,) = filled
            contents = {tuple(r.all_token_ids[i * bs : i * bs + filled]) for r, _ in held}
            assert len(contents) == 1, f"block {block_id} holds different tokens"
            one_family = len({self.family[r.request_id] for r, _ in held}) == 1
            if not one_family:
                block = kv.pool.blocks[block_id]
                assert filled == bs, f"block {block_id}: partial block shared across requests"
                assert block.block_hash is not None, f"block {block_id} shared, not cached"
                assert kv.pool.get_cached_block(block.block_hash) is block


add_op = st.tuples(
    st.just("add"),
    st.one_of(st.integers(1, MAX_PROMPT), st.integers(40, MAX_PROMPT)),  # prompt length
    st.integers(1, MAX_OUTPUT),  # max_tokens
    st.sampled_from([0, 8, 20, 33, MAX_PROMPT]),  # tokens taken from a shared prefix
    st.integers(0, len(PREFIXES) - 1),  # which prefix
    st.sampled_from([1, 1, 1, 2, 3]),  # n: samples forked from the prompt
    st.one_of(st.none(), st.integers(1, MAX_OUTPUT)),  # output index that samples EOS
)
step_op = st.tuples(st.just("step"), st.integers(1, 6))  # that many steps in a row
abort_op = st.tuples(st.just("abort"), st.integers(0, 1000), st.booleans())
ops_strategy = st.lists(st.one_of(add_op, step_op, add_op, step_op, abort_op),
                        min_size=10, max_size=40)


@st.composite
def engines(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    min_blocks = cdiv(MAX_LEN, block_size)  # one max-length request always fits
    num_blocks = min_blocks + draw(st.integers(0, min_blocks // 4))
    chunked = draw(st.booleans())
    if chunked:
        budget = draw(st.sampled_from([1, 5, 16, 64, 256]))
    else:
        budget = draw(st.sampled_from([MAX_LEN, 256]))
    config = SchedulerConfig(
        max_num_seqs=draw(st.integers(1, 8)),
        max_num_batched_tokens=budget,
        max_model_len=MAX_LEN,
        enable_chunked_prefill=chunked,
    )
    caching = draw(st.sampled_from([True, True, False]))
    return Scheduler(config, KVCacheManager(num_blocks, block_size, caching))


# No explain phase: on a failure it re-runs the shrunk case many times (minutes here).
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink])
@given(sched=engines(), ops=ops_strategy, drain=st.booleans())
def test_random_add_step_abort(sched, ops, drain):
    w = World(sched)
    for op in ops:
        if op[0] == "add":
            _, length, max_tokens, shared, prefix_id, n, eos = op
            shared = min(shared, length)
            unique = 1_000_000 + 1000 * len(w.members)
            prompt = PREFIXES[prefix_id][:shared] + list(range(unique, unique + length - shared))
            # n > max_num_seqs has its own test (test_scheduler.py); here n fits a step.
            w.add(prompt, max_tokens, min(n, sched.config.max_num_seqs), eos)
        elif op[0] == "step":
            for _ in range(op[1]):
                w.step()
                w.check()
        elif w.added:
            w.abort(op[1], whole_family=op[2])
        w.check()

    if drain:  # only steps from here on: everything must finish, in bounded steps
        bound = 10 + 3 * sum(r.num_prompt_tokens + r.sampling_params.max_tokens
                             for r in w.added if not r.is_finished)
        steps = 0
        while sched.has_unfinished_requests():
            steps += 1
            assert steps <= bound, f"deadlock: unfinished after {bound} steps"
            w.step()
            w.check()
    else:
        live = list(sched.requests)
        done = sched.finish_requests(live, RequestStatus.FINISHED_ABORTED)
        assert [r.request_id for r in done] == live
        w.aborted.update(live)
        w.check()

    # Nothing leaks: every block free with no references, no per-request state left.
    kv = sched.kv
    assert not sched.has_unfinished_requests() and sched.pending_forks == {}
    assert sched.running == [] and len(sched.waiting) == 0
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
    assert kv.stats(0).used_blocks == 0
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert kv.req_blocks == {} and kv.req_hashes == {} and kv.req_num_cached_blocks == {}
    kv.check_integrity()

    event(f"preempted: {sched.num_preemptions > 0}")
    event(f"prefix hit: {kv.prefix_cache_hits > 0}")
    event(f"block shared: {w.max_sharing > 1}")
    event(f"forked: {len(w.added) > len(w.members)}")

    # No request lost: each one either finished on its own (by the rules) or was aborted.
    for req in w.added:
        assert req.is_finished, req.request_id
        if req.request_id in w.aborted:
            assert req.status == RequestStatus.FINISHED_ABORTED
            continue
        max_tokens = req.sampling_params.max_tokens
        assert 1 <= req.num_output_tokens <= max_tokens
        if req.status == RequestStatus.FINISHED_STOPPED:
            assert req.output_token_ids[-1] == EOS
            assert req.num_output_tokens == w.eos_at[req.request_id]
        else:
            assert req.status == RequestStatus.FINISHED_LENGTH
            assert req.num_output_tokens == max_tokens
            assert EOS not in req.output_token_ids
