"""BlockPool: LRU free list, exact block ids, reference counts, prefix-hash table, eviction.

Pure bookkeeping (no tensors): every assertion names exact block ids and list orders.
"""

import pytest

from pagedserve.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock, hash_block_tokens


def free_ids(pool: BlockPool) -> list[int]:
    """Free list, head (next handed out) first."""
    return [b.block_id for b in pool.free_queue]


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


H1 = hash_block_tokens(None, [1, 2, 3, 4])
H2 = hash_block_tokens(H1, [5, 6, 7, 8])


# -- construction and hashing -------------------------------------------------------------

def test_new_pool_is_all_free_in_id_order():
    pool = BlockPool(5, enable_caching=True)
    assert free_ids(pool) == [0, 1, 2, 3, 4]
    assert pool.num_free_blocks == 5 and pool.num_cached_blocks == 0
    assert all(b.ref_cnt == 0 and b.block_hash is None for b in pool.blocks)
    pool.check_integrity()


@pytest.mark.parametrize("n", [0, -1])
def test_num_blocks_must_be_positive(n):
    with pytest.raises(ValueError, match="num_blocks must be >= 1"):
        BlockPool(n, enable_caching=True)


def test_hash_is_deterministic_and_chained():
    assert hash_block_tokens(None, [1, 2, 3, 4]) == H1
    assert hash_block_tokens(H1, (5, 6, 7, 8)) == H2  # any iterable of ids
    # Same tokens under another parent: another key.
    assert hash_block_tokens(H2, [5, 6, 7, 8]) != H2
    assert hash_block_tokens(None, [5, 6, 7, 8]) != H2
    # Token boundaries matter: [1, 23] is not [12, 3].
    assert hash_block_tokens(None, [1, 23]) != hash_block_tokens(None, [12, 3])
    assert hash_block_tokens(None, [1, 2, 3]) != hash_block_tokens(None, [1, 2, 4])


# -- taking and freeing -------------------------------------------------------------------

def test_get_new_blocks_takes_head_of_free_list_with_one_ref():
    pool = BlockPool(6, enable_caching=True)
    got = pool.get_new_blocks(3)
    assert ids(got) == [0, 1, 2]
    assert [b.ref_cnt for b in got] == [1, 1, 1]
    assert free_ids(pool) == [3, 4, 5] and pool.num_free_blocks == 3
    assert ids(pool.get_new_blocks(2)) == [3, 4]
    assert ids(pool.get_new_blocks(0)) == []
    assert free_ids(pool) == [5]
    pool.check_integrity()


def test_freed_blocks_join_tail_in_given_order_lru():
    pool = BlockPool(6, enable_caching=True)
    a = pool.get_new_blocks(3)  # 0, 1, 2
    pool.free_blocks(reversed(a))  # tail first, as KVCacheManager.free does
    assert free_ids(pool) == [3, 4, 5, 2, 1, 0]
    # Least recently freed first: the never-used blocks, then 2, 1, 0.
    assert ids(pool.get_new_blocks(4)) == [3, 4, 5, 2]
    assert free_ids(pool) == [1, 0]
    pool.check_integrity()


def test_shared_block_stays_out_of_free_list_until_last_ref_drops():
    pool = BlockPool(3, enable_caching=True)
    (b,) = pool.get_new_blocks(1)
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.free_blocks([b])
    assert b.ref_cnt == 1 and free_ids(pool) == [1, 2]
    pool.free_blocks([b])
    assert b.ref_cnt == 0 and free_ids(pool) == [1, 2, 0]
    pool.check_integrity()


def test_over_asking_raises_and_changes_nothing():
    pool = BlockPool(3, enable_caching=True)
    pool.get_new_blocks(2)
    with pytest.raises(RuntimeError, match="asked for 2 blocks, 1 free"):
        pool.get_new_blocks(2)
    assert free_ids(pool) == [2]
    pool.check_integrity()


def test_over_freeing_raises():
    pool = BlockPool(3, enable_caching=True)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(RuntimeError, match="block 0 freed more often than taken"):
        pool.free_blocks([b])


def test_free_queue_popleft_on_empty_raises():
    q = FreeBlockQueue([KVCacheBlock(7)])
    assert q.popleft().block_id == 7
    with pytest.raises(RuntimeError, match="no free block"):
        q.popleft()
    assert q.num_free_blocks == 0


def test_free_queue_remove_from_middle_is_linked():
    blocks = [KVCacheBlock(i) for i in range(4)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    q.remove(blocks[0])
    assert [b.block_id for b in q] == [1, 3] and q.num_free_blocks == 2
    q.append(blocks[0])
    assert [b.block_id for b in q] == [1, 3, 0]
    assert blocks[2].prev_free is None and blocks[2].next_free is None


# -- prefix-hash table --------------------------------------------------------------------

def test_touch_of_free_cached_block_removes_it_from_free_list():
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, H1)
    pool.free_blocks([b, a])
    assert free_ids(pool) == [2, 3, 1, 0] and pool.num_free_blocks == 4
    hit = pool.get_cached_block(H1)
    assert hit is a and hit.ref_cnt == 0
    pool.touch([hit])
    assert hit.ref_cnt == 1 and hit.block_hash == H1
    assert free_ids(pool) == [2, 3, 1] and pool.num_free_blocks == 3
    assert pool.num_cached_blocks == 1
    pool.check_integrity()
    # The touched block is no longer handed out.
    assert ids(pool.get_new_blocks(3)) == [2, 3, 1]
    assert pool.get_cached_block(H1) is a


def test_eviction_drops_hash_only_when_block_is_handed_out_again():
    pool = BlockPool(3, enable_caching=True)
    (a,) = pool.get_new_blocks(1)  # block 0
    pool.cache_block(a, H1)
    pool.free_blocks([a])
    assert free_ids(pool) == [1, 2, 0]
    # Freed but still cached: the hash entry lives on.
    assert pool.get_cached_block(H1) is a and pool.num_cached_blocks == 1
    # Handing out blocks 1 and 2 does not touch block 0's entry.
    assert ids(pool.get_new_blocks(2)) == [1, 2]
    assert pool.get_cached_block(H1) is a and a.block_hash == H1
    # Block 0 handed out again: now it is evicted.
    (again,) = pool.get_new_blocks(1)
    assert again is a and a.block_hash is None and a.ref_cnt == 1
    assert pool.get_cached_block(H1) is None and pool.num_cached_blocks == 0
    pool.check_integrity()


def test_cache_block_keeps_first_block_for_duplicate_hash():
    pool = BlockPool(3, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, H1)
    pool.cache_block(b, H1)  # same contents computed twice in one step
    assert pool.get_cached_block(H1) is a
    assert a.block_hash == H1 and b.block_hash is None
    assert pool.num_cached_blocks == 1
    # Re-caching an already hashed block under another hash changes nothing.
    pool.cache_block(a, H2)
    assert a.block_hash == H1 and pool.get_cached_block(H2) is None
    # Freeing and re-using the duplicate does not disturb the canonical entry.
    pool.free_blocks([b])
    assert free_ids(pool) == [2, 1]
    pool.get_new_blocks(2)
    assert pool.get_cached_block(H1) is a
    pool.check_integrity()


def test_caching_disabled_records_nothing():
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, H1)
    assert a.block_hash is None and pool.get_cached_block(H1) is None
    assert pool.num_cached_blocks == 0


def test_reset_prefix_cache_forgets_every_hash():
    pool = BlockPool(3, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, H1)
    pool.cache_block(b, H2)
    pool.free_blocks([a])
    pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0
    assert a.block_hash is None and b.block_hash is None
    assert pool.get_cached_block(H1) is None and pool.get_cached_block(H2) is None
    assert b.ref_cnt == 1 and free_ids(pool) == [2, 0]
    pool.check_integrity()


# -- check_integrity catches corruption ---------------------------------------------------

def _corrupt_free_block_with_ref(pool):
    pool.blocks[3].ref_cnt = 1


def _corrupt_used_block_lost(pool):
    pool.blocks[0].ref_cnt = 0  # in use (out of the free list) yet unreferenced


def _corrupt_free_count(pool):
    pool.free_queue.num_free_blocks += 1


def _corrupt_hash_table(pool):
    pool.cached[H2] = pool.blocks[1]  # entry whose block does not carry that hash


def _corrupt_block_twice_in_free_list(pool):
    pool.free_queue.append(KVCacheBlock(4))  # a second entry for block id 4


@pytest.mark.parametrize("corrupt, message", [
    (_corrupt_free_block_with_ref, "free block with references"),
    (_corrupt_used_block_lost, "used block lost"),
    (_corrupt_free_count, "free count drifted"),
    (_corrupt_hash_table, "hash table entry points to a re-used block"),
    (_corrupt_block_twice_in_free_list, "block twice in free list"),
])
def test_check_integrity_catches_corruption(corrupt, message):
    pool = BlockPool(5, enable_caching=True)
    a, _, _ = pool.get_new_blocks(3)
    pool.cache_block(a, H1)
    pool.check_integrity()
    corrupt(pool)
    with pytest.raises(AssertionError, match=message):
        pool.check_integrity()
