"""Property test: random mixes of n-requests (n = 1..4, greedy or seeded sampling, chunked prompts) on a
tiny block pool, with random aborts (before and after the fork), recompute or swap preemption and prefix
caching on or off, keep the KV bookkeeping exact after every step (the engine's check_integrity: every
block's ref count equals the block-table entries pointing at it, free + cached + in use = total) and
free everything at the end; every request that was not aborted ends with n finished completions of
max_tokens tokens each."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from draftsmith.serve_eval.engine import EngineConfig, LLMEngine, SamplingParams
from draftsmith.serve_eval.engine.model_executor import ModelExecutor
from spec_helpers import make_llama

MAX_LEN = 40
VOCAB = 16   # prompts collide often, so prefix caching gets exercised


@pytest.fixture(scope="module")
def executor(tmp_path_factory):
    """One tiny model for every example; each engine allocates its own KV cache in it."""
    target = make_llama(tmp_path_factory.mktemp("props") / "target", vocab=VOCAB, hidden=16, layers=1)
    return str(target), ModelExecutor(str(target))


request = st.tuples(st.integers(1, 14), st.integers(1, 4), st.integers(1, 12), st.booleans())
engine_setup = st.fixed_dictionaries({
    "block_size": st.sampled_from([2, 4]), "extra_blocks": st.integers(0, 4),
    "num_cpu_blocks": st.sampled_from([0, 48]), "swap_threshold_tokens": st.sampled_from([0, 8, 1000]),
    "enable_prefix_caching": st.booleans(), "prefill_chunk_size": st.sampled_from([3, 8, 64]),
    "max_num_seqs": st.sampled_from([4, 16]),
})
action = st.one_of(st.tuples(st.just("add"), request), st.tuples(st.just("step"), st.integers(1, 3)),
                   st.tuples(st.just("abort"), st.integers(0, 50)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(setup=engine_setup, actions=st.lists(action, min_size=1, max_size=40), seed=st.integers(0, 1000))
def test_fork_cow_and_free_keep_block_accounting_exact(executor, setup, actions, seed):
    model, ex = executor
    bs = setup.pop("block_size")
    min_blocks = -(-MAX_LEN // bs)
    engine = LLMEngine(EngineConfig(model, block_size=bs, num_gpu_blocks=min_blocks + setup.pop("extra_blocks"),
                                    max_model_len=MAX_LEN, **setup), executor=ex)
    live: dict[str, SamplingParams] = {}
    finals = {}

    def step() -> None:
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        engine.check_integrity()

    for i, act in enumerate(actions):
        if act[0] == "add":
            prompt_len, n, max_tokens, sampled = act[1]
            prompt = [(seed + i * 7 + j * (j % 3)) % VOCAB for j in range(prompt_len)]
            params = SamplingParams(n=min(n, setup["max_num_seqs"]), temperature=1.0 if sampled else 0.0,
                                    seed=seed + i, max_tokens=max_tokens, ignore_eos=True)
            engine.add_request(f"r{i}", prompt, params)
            live[f"r{i}"] = params
        elif act[0] == "step":
            for _ in range(act[1]):
                if engine.has_unfinished_requests():
                    step()
        elif live:
            victim = sorted(live)[act[1] % len(live)]
            engine.abort(victim)
            del live[victim]
            engine.check_integrity()
    steps = 0
    while engine.has_unfinished_requests():
        step()
        steps += 1
        assert steps < 2000, "engine stalled"
    assert engine.kv.pool.num_used_blocks == 0
    assert engine.kv.cpu_pool is None or engine.kv.cpu_pool.num_used_blocks == 0
    assert not engine.kv.block_tables and not engine.kv.cpu_tables
    assert not engine.requests and not engine.sample_groups
    for request_id, params in live.items():
        out = finals[request_id]
        assert len(out.completions) == params.n
        assert all(c.finished and len(c.output_token_ids) == params.max_tokens for c in out.completions)
