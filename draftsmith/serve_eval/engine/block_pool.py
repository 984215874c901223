"""BlockPool: fixed-size KV blocks with ref counts, an O(1) LRU free list and a prefix-hash map.

A block is in exactly one of three states:
  in use        ref_cnt > 0 (held by >= 1 block table), not in the free queue;
  cached-free   ref_cnt == 0, carries a block hash (its KV can still be hit), in the free queue;
  free          ref_cnt == 0, no hash, in the free queue.
Allocation pops the queue's front. Uncached blocks are pushed to the front when freed and
cached ones to the back, so cached blocks are evicted last and among themselves in LRU order.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence as Seq


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "parent_hash", "token_ids", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Prefix-cache identity (set only for full blocks): chained hash, the parent's hash
        # and the tokens, so a hit is confirmed by comparing tokens, not just a hash.
        self.block_hash: int | None = None
        self.parent_hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.prev: KVBlock | None = None   # free-queue links; None when not queued
        self.next: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with sentinels: push/pop/remove are O(1)."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-2)
        self._head.next, self._tail.prev = self._tail, self._head
        self.num_blocks = 0
        for block in blocks:
            self.append(block)

    def _link_after(self, anchor: KVBlock, block: KVBlock) -> None:
        nxt = anchor.next
        block.prev, block.next = anchor, nxt
        anchor.next = block
        nxt.prev = block
        self.num_blocks += 1

    def append(self, block: KVBlock) -> None:       # most recently used end
        self._link_after(self._tail.prev, block)

    def appendleft(self, block: KVBlock) -> None:   # next to be allocated
        self._link_after(self._head, block)

    def remove(self, block: KVBlock) -> None:
        block.prev.next = block.next
        block.next.prev = block.prev
        block.prev = block.next = None
        self.num_blocks -= 1

    def popleft(self) -> KVBlock:
        if self.num_blocks == 0:
            raise RuntimeError("no free KV blocks")
        block = self._head.next
        self.remove(block)
        return block

    def __iter__(self):
        node = self._head.next
        while node is not self._tail:
            yield node
            node = node.next

    def __len__(self) -> int:
        return self.num_blocks


def hash_block(parent_hash: int | None, token_ids: Seq[int]) -> int:
    """Chained block hash: a block's identity includes every token before it."""
    return hash((parent_hash, tuple(token_ids)))


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, KVBlock] = {}          # block hash -> the block holding it
        self.num_cached_free = 0                     # cached blocks with ref_cnt == 0
        # Prefix cache counters (in blocks) for the hit-rate stat.
        self.num_queries = 0
        self.num_hits = 0

    # -- counts --------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take now: free plus evictable cached-free."""
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    # -- allocation ----------------------------------------------------------------
    def allocate(self, n: int) -> list[KVBlock]:
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:      # evict the LRU cached block
                self._uncache(block)
                self.num_cached_free -= 1
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on each block (prefix-cache hit or fork)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                if block.block_hash is not None:
                    self.num_cached_free -= 1
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference on each block. Pass a table tail-first so a sequence's
        later blocks (least likely to be shared) are evicted before its prefix."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"double free of {block}"
            if block.ref_cnt == 0:
                if block.block_hash is not None:
                    self.free_queue.append(block)
                    self.num_cached_free += 1
                else:
                    self.free_queue.appendleft(block)

    # -- prefix cache --------------------------------------------------------------
    def lookup(self, block_hash: int, parent_hash: int | None, token_ids: Seq[int]) -> KVBlock | None:
        self.num_queries += 1
        block = self.cached.get(block_hash)
        if block is None or block.parent_hash != parent_hash or block.token_ids != tuple(token_ids):
            return None
        self.num_hits += 1
        return block

    def cache_block(self, block: KVBlock, block_hash: int, parent_hash: int | None,
                    token_ids: Seq[int]) -> None:
        """Publish a full, in-use block. A hash already held by another block is left
        alone (the duplicate stays private and is freed like any block)."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash, block.parent_hash, block.token_ids = block_hash, parent_hash, tuple(token_ids)
        self.cached[block_hash] = block

    def uncache(self, block: KVBlock) -> None:
        """Withdraw an in-use block from the cache before its contents change."""
        assert block.ref_cnt > 0
        if block.block_hash is not None:
            self._uncache(block)

    def _uncache(self, block: KVBlock) -> None:
        del self.cached[block.block_hash]
        block.block_hash = block.parent_hash = block.token_ids = None

    def reset_prefix_cache(self) -> None:
        """Forget every cached-free block (e.g. after weights change)."""
        for block in list(self.cached.values()):
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                self._uncache(block)
                self.free_queue.appendleft(block)
            else:
                self._uncache(block)
        self.num_cached_free = 0

    # -- integrity -----------------------------------------------------------------
    def check_integrity(self, expected_refs: dict[int, int]) -> None:
        """expected_refs: block id -> number of block-table entries pointing at it."""
        queued = list(self.free_queue)
        queued_ids = {b.block_id for b in queued}
        assert len(queued_ids) == len(queued) == self.free_queue.num_blocks, "free queue corrupt"
        cached_free = sum(1 for b in queued if b.block_hash is not None)
        assert cached_free == self.num_cached_free, (cached_free, self.num_cached_free)
        in_use = 0
        for block in self.blocks:
            refs = expected_refs.get(block.block_id, 0)
            assert block.ref_cnt == refs, f"{block}: ref_cnt {block.ref_cnt} != {refs} table refs"
            assert (block.ref_cnt == 0) == (block.block_id in queued_ids), f"{block} queue state"
            in_use += block.ref_cnt > 0
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block, f"{block} not in hash map"
        free_uncached = len(queued) - cached_free
        assert free_uncached + cached_free + in_use == self.num_blocks
        assert all(b.block_hash == h for h, b in self.cached.items())
