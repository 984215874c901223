"""Scheduler behaviour in hand-made scenarios (no model: a step advances counters and appends a token)."""
import pytest

from draftsmith.serve_eval.engine.kv_cache_manager import KVCacheManager
from draftsmith.serve_eval.engine.request import Sequence, SequenceStatus
from draftsmith.serve_eval.engine.sampling_params import SamplingParams
from draftsmith.serve_eval.engine.scheduler import Scheduler, SchedulerConfig


def make(num_blocks=64, block_size=4, cpu=0, **cfg):
    kv = KVCacheManager(num_blocks, block_size, cpu, enable_prefix_caching=False, watermark=0.0)
    return Scheduler(SchedulerConfig(**cfg), kv), kv


def seq(rid, n, priority=0, arrival=None, start=0):
    return Sequence(rid, list(range(start, start + n)), SamplingParams(max_tokens=100), priority, arrival_time=arrival)


def advance(sched, out):
    """What the engine does after a forward: count computed tokens, sample at the prompt's end."""
    for s, n, la in zip(out.seqs, out.num_scheduled_tokens, out.num_lookahead_tokens):
        s.num_computed_tokens += n + la
        if s.num_computed_tokens >= s.num_tokens:
            sched.kv.rollback(s, la)
            s.token_ids.append(7)
    sched.kv.check_integrity()


def test_token_budget_and_chunked_prefill():
    """Per-step tokens never exceed the budget; a long prompt is cut into chunk-sized pieces."""
    sched, _ = make(max_num_batched_tokens=48, prefill_chunk_size=32)
    a, b = seq("a", 70), seq("b", 20)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert out.num_scheduled_tokens == [32, 16] and out.num_batched_tokens == 48
    advance(sched, out)
    out = sched.schedule()
    assert [s.request_id for s in out.seqs] == ["a", "b"] and out.num_scheduled_tokens == [32, 4]
    advance(sched, out)
    out = sched.schedule()   # a: last 6 prompt tokens; b: one decode token
    assert out.num_scheduled_tokens == [6, 1]


def test_running_before_waiting_and_max_num_seqs():
    """Decoding sequences are scheduled before new arrivals, and admission stops at max_num_seqs."""
    sched, _ = make(max_num_batched_tokens=10, max_num_seqs=2)
    sched.add(seq("a", 4))
    advance(sched, sched.schedule())
    for rid in "bcd":
        sched.add(seq(rid, 30))
    out = sched.schedule()
    assert [s.request_id for s in out.seqs] == ["a", "b"] and out.num_scheduled_tokens == [1, 9]
    assert [s.request_id for s in sched.waiting] == ["c", "d"]


def test_higher_tier_admitted_first():
    """A later high-priority request is admitted before earlier low-priority ones."""
    sched, _ = make(max_num_batched_tokens=8)
    sched.add(seq("low", 8, priority=0, arrival=1.0))
    sched.add(seq("high", 8, priority=2, arrival=2.0))
    out = sched.schedule()
    assert [s.request_id for s in out.seqs] == ["high"]


def test_out_of_blocks_preempts_lowest_tier_then_latest_arrival():
    """When running sequences cannot grow, the victim is the lowest tier, and within it the latest
    arrival; the high-tier sequence keeps running."""
    sched, kv = make(num_blocks=6, block_size=4)
    hi, lo_old, lo_new = seq("hi", 8, 1, 1.0), seq("lo_old", 7, 0, 2.0), seq("lo_new", 7, 0, 3.0)
    for s in (hi, lo_old, lo_new):
        sched.add(s)
    advance(sched, sched.schedule())         # 2 + 2 + 2 blocks: pool full
    assert kv.pool.num_free_blocks == 0
    out = sched.schedule()                   # hi needs a 3rd block (pos 8)
    assert out.preempted == [lo_new] and lo_new.status is SequenceStatus.WAITING
    assert [s.request_id for s in out.seqs] == ["hi", "lo_old"]


def test_high_tier_waiting_preempts_lower_running():
    """A waiting request of a higher tier evicts running lower-tier sequences to get its chunk in."""
    sched, kv = make(num_blocks=4, block_size=4)
    low = seq("low", 15, priority=0)
    sched.add(low)
    advance(sched, sched.schedule())
    urgent = seq("urgent", 8, priority=5)
    sched.add(urgent)
    out = sched.schedule()
    assert low in out.preempted and [s.request_id for s in out.seqs] == ["urgent"]


@pytest.mark.parametrize("threshold, swapped", [(12, True), (100, False)])
def test_short_recomputes_long_swaps(threshold, swapped):
    """Out of blocks, the latest arrival (15 computed tokens) is swapped to the CPU pool when at or
    above the threshold, else recomputed (blocks dropped, back to waiting); a swapped sequence
    comes back (swap-in) once blocks free up, before any waiting request."""
    sched, kv = make(num_blocks=6, block_size=4, cpu=16, swap_threshold_tokens=threshold)
    short, long_ = seq("short", 8, arrival=1.0), seq("long", 15, arrival=2.0)
    sched.add(short)
    sched.add(long_)
    advance(sched, sched.schedule())          # short: 2 blocks, long: 4 blocks, pool full
    out = sched.schedule()                    # short needs a 3rd block
    assert out.preempted == [long_]
    if swapped:
        assert long_.status is SequenceStatus.SWAPPED and len(out.blocks_to_swap_out) == 4
        assert len(kv.cpu_tables[long_.seq_id]) == 4 and long_.num_computed_tokens == 15
    else:
        assert long_.status is SequenceStatus.WAITING and long_.num_computed_tokens == 0
        assert not out.blocks_to_swap_out and long_.seq_id not in kv.cpu_tables
    advance(sched, out)
    sched.abort(short)
    out = sched.schedule()
    assert out.seqs == [long_] and long_.status is SequenceStatus.RUNNING
    assert bool(out.blocks_to_swap_in) == swapped
    assert out.num_scheduled_tokens == ([1] if swapped else [16])   # recompute: prompt + its sampled token
    kv.check_integrity()


def test_abort_frees_blocks_immediately():
    """abort() releases every block of the sequence without waiting for a step."""
    sched, kv = make()
    s = seq("a", 30)
    sched.add(s)
    advance(sched, sched.schedule())
    assert kv.pool.num_used_blocks == 8
    sched.abort(s)
    assert kv.pool.num_used_blocks == 0 and not sched.has_unfinished() and s.finish_reason == "abort"


def test_lookahead_slots_for_speculative_decode():
    """A decoding sequence with k lookahead tokens is scheduled for 1 + k slots (budget permitting),
    with blocks reserved for all of them; prefill chunks never get lookahead."""
    sched, kv = make(max_num_batched_tokens=5, block_size=4)
    s = seq("a", 4)
    s.num_lookahead_tokens = 6
    sched.add(s)
    out = sched.schedule()
    assert out.num_lookahead_tokens == [0]
    advance(sched, out)
    out = sched.schedule()
    assert out.num_scheduled_tokens == [1] and out.num_lookahead_tokens == [4]   # budget caps 1 + 6 at 5
    assert kv.num_blocks_held(s) * 4 >= s.num_computed_tokens + 5
