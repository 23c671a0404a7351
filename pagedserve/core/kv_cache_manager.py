"""Block tables per request on top of the block pool: allocate, grow, share, free.

A request's block table maps logical block i (tokens ``[i*block_size, (i+1)*block_size)``)
to a physical block id::

    tokens        t0..t15 | t16..t31 | t32..t35
    block table   [   7   ,    2     ,    9    ]     block_size = 16
    slot of t33 = 9 * 16 + (33 % 16) = 145

Running out of blocks is a return value (``allocate_slots`` returns None), not an error:
the scheduler preempts and tries again.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.core.block_pool import BlockHash, BlockPool, KVCacheBlock, hash_block_tokens
from pagedserve.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class KVCacheStats:
    """Snapshot of the KV pool (``LLM.kv_cache_stats()``).

    ``num_tokens`` counts tokens whose K/V are stored for live requests; the prefix-cache
    counters are cumulative and in tokens, as vLLM counts them.
    """

    total_blocks: int
    free_blocks: int
    used_blocks: int
    cached_blocks: int
    block_size: int
    num_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0-1 (vLLM's ``kv_cache_usage_perc``)."""
        return self.used_blocks / self.total_blocks


class KVCacheManager:
    """Owns every request's block table.

    Args:
        num_blocks: physical blocks in the pool.
        block_size: tokens per block.
        enable_caching: automatic prefix caching.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_hashes: dict[str, list[BlockHash]] = {}
        self.req_num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.pending_copies: list[tuple[int, int]] = []

    # -- prefix cache -------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of ``request`` in full blocks, and its length in tokens.

        The last token is never served from the cache: its logits are needed. Requests
        that want prompt logprobs compute their whole prompt.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        hashes = self._block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        num_tokens = len(blocks) * self.block_size
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_tokens
        return blocks, num_tokens

    def _block_hashes(self, request: Request) -> list[BlockHash]:
        """Chained hashes of the request's full blocks, extended as it grows."""
        hashes = self.req_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        for i in range(len(hashes), request.num_tokens // bs):
            parent = hashes[-1] if hashes else _first_parent(request)
            hashes.append(hash_block_tokens(parent, request.all_token_ids[i * bs : (i + 1) * bs]))
        return hashes

    # -- allocation ---------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] = (),
        num_lookahead_tokens: int = 0,
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens after ``request.num_computed_tokens``
        (plus the prefix-cache hit ``new_computed_blocks``, for a request just admitted),
        and ``num_lookahead_tokens`` slots after those (a draft model writes its K/V there).

        A shared, partly filled block about to be written is copied first (copy-on-write;
        the ``(src, dst)`` pair is queued in ``pending_copies``). Returns the ids of newly
        taken blocks, or None when the pool cannot supply them (nothing changes then).
        """
        blocks = self.req_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_total = num_computed + num_new_tokens
        num_needed = (cdiv(num_total + num_lookahead_tokens, self.block_size) - len(blocks)
                      - len(new_computed_blocks))
        # The block receiving the first new token is written in place: it must be ours alone.
        write_index = num_computed // self.block_size
        cow = write_index < len(blocks) and blocks[write_index].ref_cnt > 1
        # Cached hits with no owner sit in the free list: taking them shrinks it.
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if max(num_needed, 0) + cow > self.pool.num_free_blocks - num_free_hits:
            if not blocks:
                del self.req_blocks[request.request_id]
            return None
        if cow:
            shared = blocks[write_index]
            (blocks[write_index],) = self.pool.get_new_blocks(1)
            self.pool.free_blocks([shared])
            self.pending_copies.append((shared.block_id, blocks[write_index].block_id))
        self.pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(max(num_needed, 0))
        blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, min(num_total, request.num_tokens))
        return [b.block_id for b in new_blocks]

    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` the parent's block table, sharing every block (reference counts).

        The blocks are copied only when one of them is written (``allocate_slots``), so
        ``n`` samples of one prompt store the prompt's K/V once.
        """
        blocks = self.req_blocks[parent.request_id]
        self.pool.touch(blocks)
        self.req_blocks[child.request_id] = list(blocks)
        self.req_num_cached_blocks[child.request_id] = self.req_num_cached_blocks.get(
            parent.request_id, 0)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write ``(src_block, dst_block)`` pairs queued since the last call."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish the request's blocks that are full once ``num_tokens`` are computed."""
        rid = request.request_id
        num_full = num_tokens // self.block_size
        start = self.req_num_cached_blocks.get(rid, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request)
        blocks = self.req_blocks[rid]
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], hashes[i])
        self.req_num_cached_blocks[rid] = num_full

    def free_excess(self, request: Request) -> None:
        """Give back the blocks past the request's tokens: slots taken for draft tokens
        that were rejected (speculative decoding). The table keeps ``cdiv(num_tokens,
        block_size)`` blocks; none of those freed is in the prefix cache (only blocks full
        of the request's own tokens are)."""
        blocks = self.req_blocks.get(request.request_id)
        keep = cdiv(request.num_tokens, self.block_size)
        if blocks is not None and len(blocks) > keep:
            self.pool.free_blocks(reversed(blocks[keep:]))
            del blocks[keep:]

    def free(self, request: Request) -> None:
        """Return the request's blocks to the pool, tail first (shared prefixes live longest)."""
        rid = request.request_id
        blocks = self.req_blocks.pop(rid, [])
        self.pool.free_blocks(reversed(blocks))
        self.req_num_cached_blocks.pop(rid, None)
        if request.is_finished:
            self.req_hashes.pop(rid, None)

    # -- queries ------------------------------------------------------------------------

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table: physical block id of each logical block."""
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def block_tables(self) -> dict[str, list[int]]:
        """Every request's block table (a copy): request id -> physical block ids."""
        return {rid: [b.block_id for b in blocks] for rid, blocks in self.req_blocks.items()}

    def stats(self, num_tokens: int) -> KVCacheStats:
        free = self.pool.num_free_blocks
        return KVCacheStats(
            total_blocks=self.pool.num_blocks,
            free_blocks=free,
            used_blocks=self.pool.num_blocks - free,
            cached_blocks=self.pool.num_cached_blocks,
            block_size=self.block_size,
            num_tokens=num_tokens,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
        )

    def check_integrity(self) -> None:
        """Pool invariants plus: each block's ref count equals the number of tables holding it."""
        self.pool.check_integrity()
        counts: dict[int, int] = {}
        for blocks in self.req_blocks.values():
            for b in blocks:
                counts[b.block_id] = counts.get(b.block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_cnt == counts.get(block.block_id, 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, "
                f"held by {counts.get(block.block_id, 0)} tables"
            )


def _first_parent(request: Request) -> BlockHash | None:
    """What the chain of a request's block hashes starts from: nothing for the base model;
    for a LoRA adapter its engine id (unique per load), so that blocks are shared only
    under the same load of the same adapter (its K/V differ from the base's, and from
    another adapter's loaded later under the same name)."""
    return None if not request.lora_id else b"lora:" + str(request.lora_id).encode()
