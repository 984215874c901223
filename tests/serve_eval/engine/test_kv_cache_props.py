"""Property tests: random add / step / abort / fork / speculative-rollback sequences keep the
KV bookkeeping consistent, and nothing leaks once every request is gone. No model involved:
a step advances num_computed_tokens as the engine would and samples a random token."""
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from draftsmith.serve_eval.engine.kv_cache_manager import KVCacheManager
from draftsmith.serve_eval.engine.request import Sequence, SequenceStatus
from draftsmith.serve_eval.engine.sampling_params import SamplingParams
from draftsmith.serve_eval.engine.scheduler import Scheduler, SchedulerConfig

VOCAB = 5   # tiny vocabulary: prompts collide often, so prefix caching gets exercised


class Sim:
    def __init__(self, num_blocks, block_size, num_cpu_blocks, caching, budget, chunk, swap_at, seed):
        self.kv = KVCacheManager(num_blocks, block_size, num_cpu_blocks, caching, watermark=0.05)
        self.sched = Scheduler(SchedulerConfig(budget, 8, chunk, swap_at), self.kv)
        self.rng = random.Random(seed)
        self.max_len = num_blocks * block_size // 2 - 4   # one max-length seq always fits
        self.live: list[Sequence] = []
        self.count = 0

    def add(self, prompt_len, max_tokens, priority):
        prompt_len = min(prompt_len, self.max_len - 1)
        max_tokens = min(max_tokens, self.max_len - prompt_len)
        # Half the prompts start with one of two shared "system prompts" (prefix-cache hits).
        shared = [[1, 2, 3, 4] * 8, [4, 3, 2, 1] * 8][self.rng.randrange(2)] if self.rng.random() < 0.5 else []
        prompt = (shared + [self.rng.randrange(VOCAB) for _ in range(prompt_len)])[:prompt_len]
        seq = Sequence(f"r{self.count}", prompt, SamplingParams(max_tokens=max_tokens), priority)
        self.count += 1
        self.sched.add(seq)
        self.live.append(seq)

    def step(self, speculate):
        out = self.sched.schedule()
        for seq, n, la in zip(out.seqs, out.num_scheduled_tokens, out.num_lookahead_tokens):
            assert self.kv.num_blocks_held(seq) * self.kv.block_size >= seq.num_computed_tokens + n + la
            seq.num_computed_tokens += n + la
            if seq.num_computed_tokens - la < seq.num_tokens:
                self.kv.cache_full_blocks(seq)   # partial prefill chunk
                continue
            accepted = self.rng.randint(0, la)   # accepted drafts + one bonus token
            for _ in range(accepted + 1):
                seq.token_ids.append(self.rng.randrange(VOCAB))
            self.kv.rollback(seq, la - accepted)
            self.kv.cache_full_blocks(seq)
            if seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_len:
                self.sched.finish(seq, "length")
            seq.num_lookahead_tokens = self.rng.randint(0, 3) if speculate else 0
        self.sched.drop_finished()
        self.live = [s for s in self.live if not s.is_finished]
        self.check()

    def abort(self, pick):
        if self.live:
            self.sched.abort(self.live.pop(pick % len(self.live)))
            self.check()

    def fork(self, pick):
        running = [s for s in self.sched.running if s.num_tokens - s.num_computed_tokens == 1]
        if running:
            child = self.sched.fork(running[pick % len(running)], f"fork{self.count}")
            self.count += 1
            self.live.append(child)
            self.check()

    def check(self):
        self.kv.check_integrity()
        held = set(self.kv.block_tables) | set(self.kv.cpu_tables)
        for seq in self.live:
            on_gpu = seq.seq_id in self.kv.block_tables
            assert (seq.status is SequenceStatus.RUNNING) == on_gpu, seq
            assert (seq.status is SequenceStatus.SWAPPED) == (seq.seq_id in self.kv.cpu_tables), seq
        assert held <= {s.seq_id for s in self.live}, "a finished sequence still holds blocks"

    def drain(self, max_steps=2000):
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                break
            self.step(speculate=False)
        assert not self.sched.has_unfinished(), "engine stalled"
        assert self.kv.pool.num_used_blocks == 0
        assert not self.kv.block_tables and not self.kv.cpu_tables
        if self.kv.cpu_pool is not None:
            assert self.kv.cpu_pool.num_used_blocks == 0


action = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 60), st.integers(1, 40), st.integers(0, 2)),
    st.tuples(st.just("add"), st.integers(1, 60), st.integers(1, 40), st.integers(0, 2)),
    st.tuples(st.just("step"), st.booleans()),
    st.tuples(st.just("step"), st.booleans()),
    st.tuples(st.just("abort"), st.integers(0, 100)),
    st.tuples(st.just("fork"), st.integers(0, 100)),
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    actions=st.lists(action, min_size=1, max_size=60),
    num_blocks=st.integers(8, 32),
    block_size=st.sampled_from([2, 4, 8]),
    num_cpu_blocks=st.sampled_from([0, 8, 64]),
    caching=st.booleans(),
    budget=st.integers(4, 64),
    chunk=st.integers(1, 32),
    swap_at=st.sampled_from([0, 10, 10_000]),
    seed=st.integers(0, 2**16),
)
def test_random_workloads_keep_integrity_and_leak_nothing(actions, num_blocks, block_size, num_cpu_blocks,
                                                          caching, budget, chunk, swap_at, seed):
    """check_integrity holds after every action (free + cached + used == total, ref counts ==
    table references, status matches where the KV lives), and after draining every request
    no GPU or CPU block is held."""
    sim = Sim(num_blocks, block_size, num_cpu_blocks, caching, budget, chunk, swap_at, seed)
    for act in actions:
        if act[0] == "add":
            sim.add(*act[1:])
        elif act[0] == "step":
            sim.step(speculate=act[1])
        elif act[0] == "abort":
            sim.abort(act[1])
        else:
            sim.fork(act[1])
    for seq in sim.live:
        seq.num_lookahead_tokens = 0
    sim.drain()


def test_shared_system_prompt_blocks_held_once():
    """N requests sharing a 64-token system prompt hold its 4 full blocks once: the used block
    count equals 4 shared + each request's private blocks, and the shared ids are identical."""
    bs, n, system = 16, 10, list(range(100, 164))
    kv = KVCacheManager(200, bs)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=4096), kv)
    seqs = [Sequence(f"r{i}", system + [i, i + 1, i + 2], SamplingParams(max_tokens=4)) for i in range(n)]
    sched.add(seqs[0])
    out = sched.schedule()            # first request computes the system prompt ...
    seqs[0].num_computed_tokens += out.num_scheduled_tokens[0]
    kv.cache_full_blocks(seqs[0])
    for s in seqs[1:]:
        sched.add(s)
    sched.schedule()                  # ... the others hit it
    tables = [kv.get_block_ids(s) for s in seqs]
    assert all(t[:4] == tables[0][:4] for t in tables)
    private = sum(len(t) - 4 for t in tables)
    assert kv.pool.num_used_blocks == 4 + private == 4 + n
    assert all(kv.pool.blocks[b].ref_cnt == n for b in tables[0][:4])
    kv.check_integrity()


def test_long_random_workloads_under_memory_pressure():
    """Long seeded random runs on small pools (hypothesis favours short ones): the same invariants
    hold while preemption by recompute and by swap, copy-on-write and prefix hits all happen."""
    totals = dict(preempt=0, swap=0, hits=0)
    for seed in range(40):
        rng = random.Random(seed)
        sim = Sim(num_blocks=rng.randint(8, 20), block_size=rng.choice([2, 4]), num_cpu_blocks=rng.choice([0, 16]),
                  caching=rng.random() < 0.7, budget=rng.randint(8, 48), chunk=rng.randint(2, 16),
                  swap_at=rng.choice([0, 12]), seed=seed)
        for _ in range(150):
            r = rng.random()
            if r < 0.3:
                sim.add(rng.randint(1, 60), rng.randint(1, 40), rng.randint(0, 2))
            elif r < 0.85:
                sim.step(speculate=rng.random() < 0.5)
            elif r < 0.93:
                sim.fork(rng.randrange(100))
            else:
                sim.abort(rng.randrange(100))
        for seq in sim.live:
            seq.num_lookahead_tokens = 0
        sim.drain()
        totals["preempt"] += sim.sched.num_preemptions
        totals["swap"] += sim.sched.num_swap_preemptions
        totals["hits"] += sim.kv.prefix_hit_tokens
    # The run must actually have exercised the interesting paths.
    assert totals["preempt"] > totals["swap"] > 0 and totals["hits"] > 0, totals
