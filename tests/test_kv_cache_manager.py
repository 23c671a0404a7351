"""KVCacheManager: block tables, growth one block at a time, prefix caching, stats.

Real ``Request`` objects with made-up token ids; no model. Block size 4 throughout, so
block boundaries are easy to count.
"""

import pytest

from pagedserve.core.kv_cache_manager import KVCacheManager, KVCacheStats, cdiv
from pagedserve.request import Request, RequestStatus
from pagedserve.sampling_params import SamplingParams

BS = 4
EOS = 2


def make_request(rid: str, prompt: list[int], **params) -> Request:
    params.setdefault("max_tokens", 16)
    return Request(rid, prompt, SamplingParams(**params), eos_token_id=EOS)


def free_ids(kv: KVCacheManager) -> list[int]:
    return [b.block_id for b in kv.pool.free_queue]


def refs(kv: KVCacheManager, block_ids: list[int]) -> list[int]:
    return [kv.pool.blocks[i].ref_cnt for i in block_ids]


def admit(kv: KVCacheManager, req: Request) -> list[int] | None:
    """What the scheduler does for a waiting request: look up the prefix, allocate the rest."""
    hits, num_cached = kv.get_computed_blocks(req)
    new = kv.allocate_slots(req, req.num_tokens - num_cached, hits)
    if new is not None:
        req.num_computed_tokens = num_cached
    return new


def compute(req: Request, n: int, token: int | None = None) -> None:
    """Pretend the model computed ``n`` tokens and (optionally) sampled one more."""
    req.num_computed_tokens += n
    if token is not None:
        req.append_output_token(token)


PROMPT = list(range(100, 110))  # 10 tokens: blocks [100..103] [104..107] [108, 109]


def test_cdiv():
    assert [cdiv(a, 4) for a in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


# -- block tables -------------------------------------------------------------------------

def test_block_table_grows_one_block_at_a_time():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=False)
    req = make_request("a", list(range(100, 106)))  # 6 tokens
    assert kv.allocate_slots(req, 6) == [0, 1]
    assert kv.block_ids("a") == [0, 1]
    compute(req, 6, token=50)  # 7 tokens, 6 computed
    # Decode tokens 7 and 8 fit into block 1; token 9 needs block 2.
    expected_new = [[], [], [2], [], [], [], [3]]
    for step, want in enumerate(expected_new):
        assert kv.allocate_slots(req, 1) == want, step
        compute(req, 1, token=51 + step)
        assert len(kv.block_ids("a")) == cdiv(req.num_computed_tokens, BS)
    assert kv.block_ids("a") == [0, 1, 2, 3]
    assert refs(kv, [0, 1, 2, 3]) == [1, 1, 1, 1]
    assert kv.pool.num_free_blocks == 4
    kv.check_integrity()


def test_interleaved_requests_get_blocks_in_free_list_order():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=False)
    a = make_request("a", list(range(100, 108)))  # 8 tokens: exactly 2 blocks
    b = make_request("b", list(range(200, 203)))  # 3 tokens
    assert kv.allocate_slots(a, 8) == [0, 1]
    assert kv.allocate_slots(b, 3) == [2]
    compute(a, 8, token=50)
    compute(b, 3, token=60)
    assert kv.allocate_slots(a, 1) == [3]  # token 9 opens a new block
    assert kv.allocate_slots(b, 1) == []  # token 4 still fits block 2
    assert kv.block_ids("a") == [0, 1, 3] and kv.block_ids("b") == [2]
    assert kv.block_ids("nobody") == []
    kv.check_integrity()


def test_chunked_allocation_covers_only_the_chunk():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=False)
    req = make_request("a", list(range(100, 111)))  # 11 tokens
    assert kv.allocate_slots(req, 5) == [0, 1]
    compute(req, 5)
    assert kv.allocate_slots(req, 5) == [2]  # tokens 5..9 -> 3 blocks
    compute(req, 5)
    assert kv.allocate_slots(req, 1) == []
    assert kv.block_ids("a") == [0, 1, 2]


def test_allocate_returns_none_and_changes_nothing_when_pool_is_short():
    kv = KVCacheManager(num_blocks=3, block_size=BS, enable_caching=False)
    a = make_request("a", list(range(100, 108)))  # 2 blocks
    b = make_request("b", list(range(200, 208)))  # 2 blocks
    assert kv.allocate_slots(a, 8) == [0, 1]
    assert kv.allocate_slots(b, 8) is None
    assert kv.block_ids("b") == [] and "b" not in kv.req_blocks
    assert free_ids(kv) == [2] and kv.pool.num_free_blocks == 1
    kv.check_integrity()
    # A running request that cannot grow keeps its table.
    compute(a, 8, token=50)
    assert kv.allocate_slots(a, 5) is None  # 13 tokens would need 4 blocks
    assert kv.block_ids("a") == [0, 1] and free_ids(kv) == [2]
    assert kv.allocate_slots(a, 1) == [2]
    assert kv.pool.num_free_blocks == 0
    kv.check_integrity()


def test_free_returns_blocks_tail_first():
    kv = KVCacheManager(num_blocks=5, block_size=BS, enable_caching=False)
    a = make_request("a", list(range(100, 110)))
    assert kv.allocate_slots(a, 10) == [0, 1, 2]
    assert free_ids(kv) == [3, 4]
    a.status = RequestStatus.FINISHED_ABORTED
    kv.free(a)
    assert free_ids(kv) == [3, 4, 2, 1, 0]
    assert kv.block_ids("a") == [] and refs(kv, [0, 1, 2]) == [0, 0, 0]
    assert kv.pool.num_free_blocks == 5
    kv.free(a)  # freeing twice is harmless: nothing left to free
    assert kv.pool.num_free_blocks == 5
    kv.check_integrity()


# -- prefix caching -----------------------------------------------------------------------

def test_full_blocks_are_published_and_hit_by_a_later_request():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=True)
    a = make_request("a", PROMPT)
    assert admit(kv, a) == [0, 1, 2]
    assert a.num_computed_tokens == 0
    assert kv.pool.num_cached_blocks == 2  # blocks 0 and 1 are full; block 2 is not
    assert [kv.pool.blocks[i].block_hash is not None for i in (0, 1, 2)] == [True, True, False]
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (10, 0)

    b = make_request("b", PROMPT[:8] + [900, 901, 902])  # shares two full blocks
    hits, num_cached = kv.get_computed_blocks(b)
    assert [x.block_id for x in hits] == [0, 1] and num_cached == 8
    assert kv.allocate_slots(b, 3, hits) == [3]
    b.num_computed_tokens = num_cached
    assert kv.block_ids("b") == [0, 1, 3]
    assert refs(kv, [0, 1, 2, 3]) == [2, 2, 1, 1]
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (21, 8)
    kv.check_integrity()


def test_last_token_is_always_recomputed():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=True)
    admit(kv, make_request("a", PROMPT))
    # The prompt is exactly two cached blocks: only the first may be served.
    b = make_request("b", PROMPT[:8])
    hits, num_cached = kv.get_computed_blocks(b)
    assert [x.block_id for x in hits] == [0] and num_cached == 4
    # A one-block prompt gets nothing from the cache.
    c = make_request("c", PROMPT[:4])
    assert kv.get_computed_blocks(c) == ([], 0)
    # One token past the boundary: both blocks.
    d = make_request("d", PROMPT[:9])
    hits, num_cached = kv.get_computed_blocks(d)
    assert [x.block_id for x in hits] == [0, 1] and num_cached == 8
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (10 + 8 + 4 + 9, 12)


def test_only_full_blocks_hit():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=True)
    admit(kv, make_request("a", PROMPT))  # block 2 holds only [108, 109]
    b = make_request("b", PROMPT + [110, 111, 112])
    hits, num_cached = kv.get_computed_blocks(b)
    assert [x.block_id for x in hits] == [0, 1] and num_cached == 8


def test_chained_hash_same_tokens_under_another_parent_do_not_hit():
    kv = KVCacheManager(num_blocks=12, block_size=BS, enable_caching=True)
    x, y, t = [10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]
    admit(kv, make_request("a", x + t + [1]))  # caches X and X->T
    admit(kv, make_request("b", y + [1]))  # caches Y only
    assert kv.pool.num_cached_blocks == 3
    # Y then T: Y hits, but T under parent Y was never computed.
    c = make_request("c", y + t + [1])
    hits, num_cached = kv.get_computed_blocks(c)
    assert [h.block_id for h in hits] == kv.block_ids("b")[:1] and num_cached == 4
    # T first: no hit at all, although T's tokens are cached under X.
    d = make_request("d", t + [1])
    assert kv.get_computed_blocks(d) == ([], 0)
    # Sanity: X then T hits both.
    e = make_request("e", x + t + [5])
    hits, num_cached = kv.get_computed_blocks(e)
    assert [h.block_id for h in hits] == kv.block_ids("a")[:2] and num_cached == 8


def test_decode_tokens_fill_and_publish_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=True)
    a = make_request("a", PROMPT[:6])
    assert admit(kv, a) == [0, 1]
    assert kv.pool.num_cached_blocks == 1
    compute(a, 6, token=50)  # 7 tokens
    kv.allocate_slots(a, 1)
    compute(a, 1, token=51)  # 8 tokens, 7 computed
    assert kv.pool.num_cached_blocks == 1
    kv.allocate_slots(a, 1)  # the step computing token 8 completes block 1
    assert kv.pool.num_cached_blocks == 2
    # A request whose prompt is the prompt plus those outputs hits both blocks.
    b = make_request("b", PROMPT[:6] + [50, 51, 77])
    hits, num_cached = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1] and num_cached == 8


def test_hits_on_blocks_of_a_finished_request():
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_caching=True)
    a = make_request("a", PROMPT)
    assert admit(kv, a) == [0, 1, 2]
    a.status = RequestStatus.FINISHED_STOPPED
    kv.free(a)
    assert free_ids(kv) == [3, 2, 1, 0] and kv.pool.num_cached_blocks == 2
    assert "a" not in kv.req_hashes

    # 14 tokens = 4 blocks: 2 from the cache (sitting in the free list) + 2 new.
    b = make_request("b", PROMPT[:8] + [900, 901, 902, 903, 904, 905])
    hits, num_cached = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1] and num_cached == 8
    assert kv.allocate_slots(b, 6, hits) == [3, 2]
    assert kv.block_ids("b") == [0, 1, 3, 2]
    assert refs(kv, [0, 1, 2, 3]) == [1, 1, 1, 1]
    assert kv.pool.num_free_blocks == 0 and kv.pool.num_cached_blocks == 3  # 0, 1, 3
    kv.check_integrity()


def test_cached_free_hits_count_against_the_free_pool():
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_caching=True)
    a = make_request("a", PROMPT)
    admit(kv, a)
    a.status = RequestStatus.FINISHED_STOPPED
    kv.free(a)
    # 18 tokens = 5 blocks: 2 hits + 3 new, but taking the hits leaves only 2 free.
    b = make_request("b", PROMPT[:8] + list(range(900, 910)))
    hits, num_cached = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1] and num_cached == 8
    assert kv.allocate_slots(b, 10, hits) is None
    assert "b" not in kv.req_blocks
    assert free_ids(kv) == [3, 2, 1, 0] and refs(kv, [0, 1, 2, 3]) == [0, 0, 0, 0]
    assert kv.pool.num_cached_blocks == 2
    kv.check_integrity()


def test_tail_is_evicted_before_prefix_then_evicted_prefix_misses():
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_caching=True)
    a = make_request("a", PROMPT[:8] + [108, 109, 110, 111, 112])  # 13 tokens, 4 blocks
    assert admit(kv, a) == [0, 1, 2, 3]
    assert kv.pool.num_cached_blocks == 3
    a.status = RequestStatus.FINISHED_LENGTH
    kv.free(a)
    assert free_ids(kv) == [3, 2, 1, 0]

    # Taking two blocks evicts the tail (3, uncached) and block 2 (cached), not 0 and 1.
    c = make_request("c", list(range(300, 308)))
    assert admit(kv, c) == [3, 2]
    assert kv.pool.num_cached_blocks == 2 + 2  # a's blocks 0, 1 + c's two full blocks
    b = make_request("b", PROMPT[:8] + [108, 109, 110, 111, 999])
    hits, num_cached = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1] and num_cached == 8  # block 2 was evicted

    # Evict block 1 too: now only block 0 hits.
    d = make_request("d", [400])
    assert admit(kv, d) == [1]
    hits, num_cached = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0] and num_cached == 4
    kv.check_integrity()


def test_free_of_preempted_request_keeps_hashes_finished_drops_them():
    kv = KVCacheManager(num_blocks=6, block_size=BS, enable_caching=True)
    a = make_request("a", PROMPT)
    admit(kv, a)
    assert len(kv.req_hashes["a"]) == 2
    a.status = RequestStatus.PREEMPTED
    kv.free(a)
    assert len(kv.req_hashes["a"]) == 2 and "a" not in kv.req_num_cached_blocks
    # Re-admitted after preemption: its own cached blocks serve it.
    a.num_computed_tokens = 0
    hits, num_cached = kv.get_computed_blocks(a)
    assert [h.block_id for h in hits] == [0, 1] and num_cached == 8
    assert kv.allocate_slots(a, 2, hits) == [3]  # never-used blocks precede freed ones
    assert kv.block_ids("a") == [0, 1, 3]
    a.status = RequestStatus.FINISHED_ABORTED
    kv.free(a)
    assert "a" not in kv.req_hashes and "a" not in kv.req_blocks
    kv.check_integrity()


def test_prompt_logprobs_requests_skip_the_cache():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=True)
    admit(kv, make_request("a", PROMPT))
    b = make_request("b", PROMPT, prompt_logprobs=0)
    assert kv.get_computed_blocks(b) == ([], 0)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (10, 0)


def test_caching_disabled_never_hits_or_hashes():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=False)
    admit(kv, make_request("a", PROMPT))
    b = make_request("b", PROMPT)
    assert kv.get_computed_blocks(b) == ([], 0)
    assert kv.pool.num_cached_blocks == 0 and kv.req_hashes == {}
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (0, 0)


# -- stats and integrity ------------------------------------------------------------------

def test_stats_fields():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=True)
    assert kv.stats(0) == KVCacheStats(
        total_blocks=8, free_blocks=8, used_blocks=0, cached_blocks=0, block_size=BS,
        num_tokens=0, prefix_cache_queries=0, prefix_cache_hits=0)
    a = make_request("a", PROMPT)
    admit(kv, a)
    b = make_request("b", PROMPT[:9])
    admit(kv, b)
    s = kv.stats(num_tokens=11)
    assert s == KVCacheStats(
        total_blocks=8, free_blocks=4, used_blocks=4, cached_blocks=2, block_size=BS,
        num_tokens=11, prefix_cache_queries=19, prefix_cache_hits=8)
    assert s.usage == 0.5
    a.status = b.status = RequestStatus.FINISHED_ABORTED
    kv.free(a)
    kv.free(b)
    s = kv.stats(0)
    assert (s.free_blocks, s.used_blocks, s.cached_blocks, s.usage) == (8, 0, 2, 0.0)


def test_check_integrity_catches_table_ref_count_mismatch():
    kv = KVCacheManager(num_blocks=6, block_size=BS, enable_caching=False)
    a = make_request("a", PROMPT)
    kv.allocate_slots(a, 10)
    kv.check_integrity()
    kv.req_blocks["ghost"] = [kv.pool.blocks[1]]  # a table holding a block without a ref
    with pytest.raises(AssertionError, match="block 1: ref_cnt 1, held by 2 tables"):
        kv.check_integrity()
    del kv.req_blocks["ghost"]
    kv.pool.blocks[2].ref_cnt += 1
    with pytest.raises(AssertionError, match="block 2: ref_cnt 2, held by 1 tables"):
        kv.check_integrity()
