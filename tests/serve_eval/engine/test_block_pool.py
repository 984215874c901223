"""Unit tests of BlockPool and KVCacheManager bookkeeping (no model involved)."""
import pytest

from draftsmith.serve_eval.engine.block_pool import BlockPool, FreeBlockQueue, KVBlock, hash_block
from draftsmith.serve_eval.engine.kv_cache_manager import KVCacheManager
from draftsmith.serve_eval.engine.request import Sequence
from draftsmith.serve_eval.engine.sampling_params import SamplingParams


def make_seq(tokens, rid="r"):
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=8))


def test_free_queue_is_a_linked_list_with_o1_remove():
    """popleft / append / appendleft / remove keep order and count consistent."""
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    q.appendleft(blocks[2])
    assert [b.block_id for b in q] == [2, 0, 1, 3, 4]
    assert q.popleft() is blocks[2]
    q.append(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4, 2] and len(q) == 5


def test_cached_blocks_evicted_last_and_in_lru_order():
    """Freed cached blocks go to the back (LRU order), plain free blocks to the front."""
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    pool.cache_block(a, 1, None, (1,))
    pool.cache_block(b, 2, 1, (2,))
    pool.free([a])   # cached, older
    pool.free([b])   # cached, newer
    pool.free([c])   # uncached: reused first
    assert pool.num_cached_free == 2
    first, second, third = pool.allocate(3)
    assert first is c and second is a and third is b
    assert a.block_hash is None and 1 not in pool.cached   # evicted on reuse
    pool.free([first, second, third])
    pool.free([d])
    pool.check_integrity({})


def test_lookup_compares_tokens_and_parent_not_only_the_hash():
    """A hash collision with different tokens or a different parent is a miss."""
    pool = BlockPool(2)
    (blk,) = pool.allocate(1)
    pool.cache_block(blk, 42, None, (1, 2))
    assert pool.lookup(42, None, (1, 2)) is blk
    assert pool.lookup(42, None, (1, 3)) is None
    assert pool.lookup(42, 7, (1, 2)) is None


def test_prefix_hit_never_covers_last_token_and_reuses_blocks():
    """A second identical prompt reuses the first's full blocks except the one with its last token."""
    kv = KVCacheManager(16, 4)
    s1, s2 = make_seq(range(12), "a"), make_seq(range(12), "b")
    assert kv.allocate_slots(s1, 12, admit=True)
    s1.num_computed_tokens = 12
    kv.cache_full_blocks(s1)
    hits = kv.lookup_prefix(s2)
    assert len(hits) == 2                       # 3 full blocks but the last token must be computed
    assert kv.allocate_slots(s2, 4, computed_blocks=hits, admit=True)
    assert s2.num_computed_tokens == 8
    assert kv.get_block_ids(s2)[:2] == kv.get_block_ids(s1)[:2]
    assert kv.prefix_hit_rate == pytest.approx(8 / 24)
    kv.check_integrity()


def test_fork_then_write_copies_the_shared_partial_block():
    """Copy-on-write: a write into a block shared after fork goes to a private copy."""
    kv = KVCacheManager(8, 4)
    parent = make_seq(range(6))
    assert kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    child = parent.fork("c")
    kv.fork(parent, child)
    kv.check_integrity()
    shared = kv.get_block_ids(parent)
    assert kv.allocate_slots(child, 1)
    (src, dst), = kv.take_pending_copies()
    assert src == shared[1] and dst not in shared
    assert kv.get_block_ids(child) == [shared[0], dst]
    kv.check_integrity()
    kv.free(parent)
    kv.free(child)
    assert kv.pool.num_used_blocks == 0


def test_write_into_cached_block_withdraws_it():
    """A cached full block rolled back to partial is uncached before being overwritten."""
    kv = KVCacheManager(8, 4)
    seq = make_seq(range(8))
    assert kv.allocate_slots(seq, 8)
    seq.num_computed_tokens = 8
    kv.cache_full_blocks(seq)
    assert len(kv.pool.cached) == 2
    del seq.token_ids[6:]
    kv.rollback(seq, 2)
    assert kv.allocate_slots(seq, 1)
    assert len(kv.pool.cached) == 1
    kv.check_integrity()


def test_rollback_frees_blocks_left_empty():
    """Rejected lookahead slots: blocks with no computed token are released."""
    kv = KVCacheManager(8, 4)
    seq = make_seq(range(4))
    assert kv.allocate_slots(seq, 4, num_lookahead_tokens=5)   # 9 slots -> 3 blocks
    assert kv.num_blocks_held(seq) == 3
    seq.num_computed_tokens = 9
    kv.rollback(seq, 5)
    assert seq.num_computed_tokens == 4 and kv.num_blocks_held(seq) == 1
    kv.check_integrity()
    with pytest.raises(ValueError, match="num_tokens"):
        kv.rollback(seq, 5)


def test_swap_out_and_in_round_trip():
    """Swap moves a table to CPU blocks and back, with matching copy pairs."""
    kv = KVCacheManager(8, 4, num_cpu_blocks=4)
    seq = make_seq(range(10))
    assert kv.allocate_slots(seq, 10)
    seq.num_computed_tokens = 10
    gpu = kv.get_block_ids(seq)
    out = kv.swap_out(seq)
    assert [g for g, _ in out] == gpu and kv.pool.num_used_blocks == 0
    kv.check_integrity()
    assert kv.can_swap_in(seq)
    back = kv.swap_in(seq)
    assert [c for c, _ in back] == [c for _, c in out]
    assert kv.cpu_pool.num_used_blocks == 0
    kv.check_integrity()


def test_allocation_failure_changes_nothing():
    """allocate_slots returns False and leaves the pool untouched when blocks run out."""
    kv = KVCacheManager(2, 4)
    seq = make_seq(range(12))
    assert not kv.allocate_slots(seq, 12)
    assert kv.pool.num_free_blocks == 2 and kv.num_blocks_held(seq) == 0
    kv.check_integrity()


def test_hash_block_is_chained():
    """The same tokens under a different parent hash differently."""
    assert hash_block(None, [1, 2]) != hash_block(hash_block(None, [0]), [1, 2])
