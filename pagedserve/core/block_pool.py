"""The pool of physical KV blocks: free list, reference counts, prefix-hash table.

The pool knows nothing of models or tensors: a block is an id, a reference count and,
once full and cached, the hash of its contents.

Free list order is LRU: blocks are taken from the head and returned to the tail, so a
freed block that still holds cached K/V lives as long as possible before it is reused
(evicted). Its hash entry is dropped only at that moment.

Invariant (``check_integrity``): every block is either in the free list with
``ref_cnt == 0`` or out of it with ``ref_cnt > 0``; every hashed block is in the table.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field

BlockHash = bytes


def hash_block_tokens(parent: BlockHash | None, token_ids: Iterable[int]) -> BlockHash:
    """Chained hash of one full block: sha256(parent hash, the block's token ids).

    sha256 makes collisions negligible, so a hit needs no token comparison. A request's
    first block chains from its LoRA adapter's key (``kv_cache_manager``); everything
    else that changes a block's K/V (model, dtype) is fixed for the engine's lifetime.
    """
    h = hashlib.sha256(parent or b"")
    h.update(b",".join(str(t).encode() for t in token_ids))
    return h.digest()


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    # Doubly linked free list threaded through the blocks: O(1) removal from the middle.
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly linked list of free blocks; head = least recently freed."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise RuntimeError("no free block (callers must check num_free_blocks first)")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free_blocks += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """``num_blocks`` physical blocks with a free list and a prefix-cache table.

    Args:
        num_blocks: blocks in the pool.
        enable_caching: keep full blocks' hashes so later requests can reuse them.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1; got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free, cached or not)."""
        return self.free_queue.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a hashed full block, in use or free."""
        return len(self.cached)

    def cached_free_block_ids(self) -> list[int]:
        """Ids of free blocks that still hold a cached full block (evictable), any order."""
        return [b.block_id for b in self.cached.values() if b.ref_cnt == 0]

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` blocks from the head of the free list (evicting their cache entry).

        Raises RuntimeError if fewer than ``n`` are free: callers check first.
        """
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} blocks, {self.num_free_blocks} free")
        blocks = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference to each block (a prefix-cache hit)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference to each block; blocks reaching zero join the free-list tail
        in the given order (pass a request's blocks tail first so its prefix is evicted last)."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"block {block.block_id} freed more often than taken")
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Record that ``block`` holds the full block ``block_hash``.

        If another block already holds the same contents (two requests computed it in the
        same step), the first stays the canonical one.
        """
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use keep their contents)."""
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            block.block_hash = None

    def check_integrity(self) -> None:
        """Raise AssertionError if the free list, ref counts and hash table disagree."""
        free = list(self.free_queue)
        assert len(free) == self.num_free_blocks, "free count drifted"
        assert len({b.block_id for b in free}) == len(free), "block twice in free list"
        assert all(b.ref_cnt == 0 for b in free), "free block with references"
        in_use = self.num_blocks - len(free)
        assert in_use == sum(1 for b in self.blocks if b.ref_cnt > 0), "used block lost"
        for h, block in self.cached.items():
            assert block.block_hash == h, "hash table entry points to a re-used block"
