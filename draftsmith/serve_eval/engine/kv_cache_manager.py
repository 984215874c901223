"""KVCacheManager: per-sequence block tables over a GPU BlockPool (+ a CPU pool for swap).

It owns the mapping token position -> physical slot; the executor only ever sees block ids.
Operations that move KV data (copy-on-write copies, swaps) are returned/queued as
(src, dst) block-id pairs; the engine hands them to the executor before the next forward,
in the order swap-out, copy, swap-in (reads of old contents before any writes).
"""
from __future__ import annotations

from draftsmith.serve_eval.engine.block_pool import BlockPool, KVBlock, hash_block
from draftsmith.serve_eval.engine.request import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_gpu_blocks: int, block_size: int, num_cpu_blocks: int = 0,
                 enable_prefix_caching: bool = True, watermark: float = 0.01) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"free_block_watermark must be in [0, 1), got {watermark}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_gpu_blocks, enable_caching=enable_prefix_caching)
        self.cpu_pool = BlockPool(num_cpu_blocks, enable_caching=False) if num_cpu_blocks > 0 else None
        # New sequences are admitted only while this many blocks stay free, so running
        # sequences can grow a little without immediately preempting each other.
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.block_tables: dict[int, list[KVBlock]] = {}
        self.cpu_tables: dict[int, list[KVBlock]] = {}
        self._num_published: dict[int, int] = {}     # seq id -> leading blocks already cached
        self._seqs: dict[int, Sequence] = {}          # for check_integrity only
        self.pending_copies: list[tuple[int, int]] = []   # copy-on-write (src, dst), GPU ids
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    # -- views ---------------------------------------------------------------------
    @property
    def num_gpu_blocks(self) -> int:
        return self.pool.num_blocks

    def get_block_ids(self, seq: Sequence) -> list[int]:
        return [b.block_id for b in self.block_tables.get(seq.seq_id, ())]

    def num_blocks_held(self, seq: Sequence) -> int:
        return len(self.block_tables.get(seq.seq_id, ()))

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0

    def _watermark(self) -> int:
        """Blocks kept free when admitting: headroom for sequences already holding blocks.
        With none holding any there is nothing to protect (and no deadlock on a tiny pool)."""
        return self.watermark_blocks if self.block_tables else 0

    # -- prefix cache ----------------------------------------------------------------
    def _extend_hashes(self, seq: Sequence, num_full_blocks: int) -> list[int]:
        hashes, bs, tokens = seq.block_hashes, self.block_size, seq.token_ids
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if i else None, tokens[i * bs:(i + 1) * bs]))
        return hashes

    def lookup_prefix(self, seq: Sequence) -> list[KVBlock]:
        """Cached blocks matching the sequence's leading full blocks. The last token is
        never covered: it must run through the model to produce the next logits."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hashes = self._extend_hashes(seq, (seq.num_tokens - 1) // bs)
        hits: list[KVBlock] = []
        for i, block_hash in enumerate(hashes[:(seq.num_tokens - 1) // bs]):
            block = self.pool.lookup(block_hash, hashes[i - 1] if i else None,
                                     seq.token_ids[i * bs:(i + 1) * bs])
            if block is None:
                break
            hits.append(block)
        return hits

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Publish blocks whose every slot holds computed KV of known tokens."""
        if not self.enable_prefix_caching:
            return
        table = self.block_tables[seq.seq_id]
        num_full = min(seq.num_computed_tokens, seq.num_tokens) // self.block_size
        start = self._num_published.get(seq.seq_id, 0)
        if num_full <= start:
            return
        hashes = self._extend_hashes(seq, num_full)
        bs = self.block_size
        for i in range(start, num_full):
            self.pool.cache_block(table[i], hashes[i], hashes[i - 1] if i else None,
                                  seq.token_ids[i * bs:(i + 1) * bs])
        self._num_published[seq.seq_id] = num_full

    # -- allocation ------------------------------------------------------------------
    def allocate_slots(self, seq: Sequence, num_new_tokens: int, num_lookahead_tokens: int = 0,
                       computed_blocks: list[KVBlock] | None = None, admit: bool = False) -> bool:
        """Make room for `num_new_tokens` (+ lookahead) slots after the computed prefix.

        computed_blocks: prefix-cache hits for a sequence holding no blocks; they advance
        num_computed_tokens. admit=True applies the free-block watermark (new sequences).
        Returns False, changing nothing, when the pool cannot supply the blocks.
        """
        computed_blocks = computed_blocks or []
        table = self.block_tables.get(seq.seq_id)
        if table is None:
            table = []
        assert not (computed_blocks and table), "prefix hits apply only to an empty table"
        start = seq.num_computed_tokens + len(computed_blocks) * self.block_size
        end = start + num_new_tokens + num_lookahead_tokens
        num_held = len(table) + len(computed_blocks)
        num_new_blocks = max(0, cdiv(end, self.block_size) - num_held)
        # Existing blocks this step writes into: shared ones need a private copy first.
        write_range = range(start // self.block_size, min(len(table), cdiv(end, self.block_size)))
        num_cow = sum(1 for i in write_range if table[i].ref_cnt > 1)
        # Hits sitting in the free queue stop being allocatable once we take them.
        num_revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        available = self.pool.num_free_blocks - num_revived
        if admit:
            available -= self._watermark()
        if num_new_blocks + num_cow > available:
            return False

        if seq.seq_id not in self.block_tables:
            self.block_tables[seq.seq_id] = table
            self._seqs[seq.seq_id] = seq
        if admit:
            self.prefix_query_tokens += seq.num_tokens
            self.prefix_hit_tokens += len(computed_blocks) * self.block_size
            seq.num_cached_prefix_tokens = len(computed_blocks) * self.block_size
        if computed_blocks:
            self.pool.touch(computed_blocks)
            table.extend(computed_blocks)
            seq.num_computed_tokens = start
            self._num_published[seq.seq_id] = len(computed_blocks)
        for i in write_range:
            block = table[i]
            if block.ref_cnt > 1:
                (copy,) = self.pool.allocate(1)
                self.pending_copies.append((block.block_id, copy.block_id))
                self.pool.free([block])
                table[i] = copy
            elif block.block_hash is not None:
                self.pool.uncache(block)   # about to be overwritten: withdraw from the cache
            self._num_published[seq.seq_id] = min(self._num_published.get(seq.seq_id, 0), i)
        if num_new_blocks:
            table.extend(self.pool.allocate(num_new_blocks))
        return True

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def free(self, seq: Sequence) -> None:
        """Release every block the sequence holds (GPU and CPU); safe to call twice."""
        table = self.block_tables.pop(seq.seq_id, None)
        if table:
            self.pool.free(reversed(table))
        cpu_table = self.cpu_tables.pop(seq.seq_id, None)
        if cpu_table:
            self.cpu_pool.free(reversed(cpu_table))
        self._num_published.pop(seq.seq_id, None)
        self._seqs.pop(seq.seq_id, None)

    def rollback(self, seq: Sequence, num_tokens: int) -> None:
        """Forget the KV of the last `num_tokens` computed tokens (rejected speculative
        tokens) and free blocks left without any computed token. Truncate seq.token_ids
        first if the tokens themselves are dropped."""
        if not 0 <= num_tokens <= seq.num_computed_tokens:
            raise ValueError(f"num_tokens must be in [0, {seq.num_computed_tokens}], got {num_tokens}")
        seq.num_computed_tokens -= num_tokens
        del seq.block_hashes[seq.num_tokens // self.block_size:]
        table = self.block_tables[seq.seq_id]
        keep = cdiv(seq.num_computed_tokens, self.block_size)
        if len(table) > keep:
            self.pool.free(reversed(table[keep:]))
            del table[keep:]
        num_full = seq.num_computed_tokens // self.block_size
        self._num_published[seq.seq_id] = min(self._num_published.get(seq.seq_id, 0), num_full)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Share all of parent's blocks with child; a later write copies (CoW)."""
        table = self.block_tables[parent.seq_id]
        self.pool.touch(table)
        self.block_tables[child.seq_id] = list(table)
        self._num_published[child.seq_id] = self._num_published.get(parent.seq_id, 0)
        self._seqs[child.seq_id] = child

    # -- swap ------------------------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> bool:
        return self.cpu_pool is not None and self.cpu_pool.num_free_blocks >= self.num_blocks_held(seq)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move the sequence's KV to CPU blocks; returns (gpu_id, cpu_id) copy pairs."""
        table = self.block_tables.pop(seq.seq_id)
        cpu_blocks = self.cpu_pool.allocate(len(table))
        self.pool.free(reversed(table))
        self.cpu_tables[seq.seq_id] = cpu_blocks
        self._num_published[seq.seq_id] = 0   # fresh GPU blocks on return: republish
        return [(g.block_id, c.block_id) for g, c in zip(table, cpu_blocks)]

    def can_swap_in(self, seq: Sequence, num_extra_blocks: int = 0) -> bool:
        need = len(self.cpu_tables[seq.seq_id]) + num_extra_blocks + self._watermark()
        return self.pool.num_free_blocks >= need

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Bring the sequence's KV back; returns (cpu_id, gpu_id) copy pairs."""
        cpu_blocks = self.cpu_tables.pop(seq.seq_id)
        table = self.pool.allocate(len(cpu_blocks))
        self.cpu_pool.free(reversed(cpu_blocks))
        self.block_tables[seq.seq_id] = table
        return [(c.block_id, g.block_id) for c, g in zip(cpu_blocks, table)]

    # -- integrity -------------------------------------------------------------------
    def check_integrity(self) -> None:
        """free + cached + in-use == total, ref counts == block-table references, and each
        table covers its sequence's computed tokens."""
        refs: dict[int, int] = {}
        for seq_id, table in self.block_tables.items():
            for block in table:
                refs[block.block_id] = refs.get(block.block_id, 0) + 1
            seq = self._seqs[seq_id]
            assert len(table) >= cdiv(seq.num_computed_tokens, self.block_size), \
                f"{seq} holds {len(table)} blocks, too few for its computed tokens"
        self.pool.check_integrity(refs)
        if self.cpu_pool is not None:
            cpu_refs: dict[int, int] = {}
            for table in self.cpu_tables.values():
                for block in table:
                    cpu_refs[block.block_id] = cpu_refs.get(block.block_id, 0) + 1
            self.cpu_pool.check_integrity(cpu_refs)
        assert not (self.cpu_tables.keys() & self.block_tables.keys()), "sequence on GPU and CPU"
