"""KV bookkeeping under speculation: after every step of runs with random accept/reject patterns
(scripted chain and tree oracles, a standalone draft), the block pools pass check_integrity and each
sequence's cache (target, and the standalone draft's own pool) holds exactly the KV of its accepted
tokens: the cached K/V equal those of a fresh prefill of those tokens."""
from __future__ import annotations

import pytest
import torch

from draftsmith.kernels.attention import AttentionMetadata
from draftsmith.serve_eval.engine import EngineConfig, LLMEngine, SamplingParams, SequenceStatus
from draftsmith.serve_eval.engine.model_executor import ModelExecutor
from draftsmith.serve_eval.speculative.config import SpecConfig
from draftsmith.serve_eval.speculative.strategy import SpeculativeStrategy
from spec_helpers import OracleProposer, greedy_reference, make_llama, noisy_copy, run_engine, workload

ENGINE = dict(block_size=4, max_model_len=96, prefill_chunk_size=16, max_num_batched_tokens=96,
              num_gpu_blocks=36, swap_threshold_tokens=40, num_cpu_blocks=64)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_rollback")
    target = make_llama(root / "target", layers=2, seed=0)
    return target, noisy_copy(target, root / "draft", noise=0.3)


def cached_kv(executor: ModelExecutor, block_ids: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of positions [0, n) from a paged cache: [L, n, kvh, hd] each."""
    bs = executor.block_size
    slots = torch.tensor([block_ids[p // bs] * bs + p % bs for p in range(n)])
    flat = lambda c: c.view(executor.num_layers, -1, executor.num_kv_heads, executor.head_dim)  # noqa: E731
    return flat(executor.k_cache)[:, slots], flat(executor.v_cache)[:, slots]


def fresh_kv(fresh: ModelExecutor, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    n = len(tokens)
    table = list(range(-(-n // fresh.block_size)))
    meta = AttentionMetadata.build([n], [n], [table], fresh.block_size)
    fresh.forward(torch.tensor(tokens), torch.arange(n), meta, torch.zeros(0, dtype=torch.long))
    return cached_kv(fresh, table, n)


def assert_same(engine_kv, fresh, what):
    for got, want in zip(engine_kv, fresh):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("kind", ["oracle-chain", "oracle-tree", "standalone"])
def test_caches_hold_exactly_the_accepted_tokens(dirs, kind):
    """Every step: integrity of every pool, and target (and draft) KV == fresh prefill of the accepted tokens."""
    target_dir, draft_dir = dirs
    prompts, lengths = workload(6, seed=11, shared_prefix=4, max_len=14, max_out=24)
    cfg = EngineConfig(str(target_dir), **ENGINE)
    if kind.startswith("oracle"):
        ref = greedy_reference(target_dir, prompts, lengths, **{**ENGINE, "num_gpu_blocks": 400})
        proposer = OracleProposer(ref, {f"r{i}": p for i, p in enumerate(prompts)}, kind.endswith("tree"),
                                  p_right=0.6, seed=5)
        tree = {"tree": "static", "tree_branching": [3, 3], "max_draft_nodes": 12} if kind.endswith("tree") else {}
        engine = LLMEngine(cfg, strategy=SpeculativeStrategy(SpecConfig("ngram", num_speculative_tokens=3, **tree),
                                                             proposer))
    else:
        # the draft's own weights in fp32, as the fresh draft below prefills them
        engine = LLMEngine(cfg, speculative=SpecConfig("standalone", draft_path=str(draft_dir), num_speculative_tokens=3,
                                                       draft_weight_storage="float32"))
    fresh_target = ModelExecutor(target_dir)
    fresh_target.allocate_kv_cache(32, 4)
    fresh_draft = None
    if kind == "standalone":
        fresh_draft = ModelExecutor(draft_dir)
        fresh_draft.allocate_kv_cache(32, 4)
    checked = {"target": 0, "draft": 0}

    def check(eng):
        eng.kv.check_integrity()
        for seq in eng.scheduler.running:
            if seq.status is not SequenceStatus.RUNNING or seq.num_computed_tokens == 0:
                continue
            n = seq.num_computed_tokens
            assert n <= seq.num_tokens
            assert_same(cached_kv(eng.executor, eng.kv.get_block_ids(seq), n),
                        fresh_kv(fresh_target, seq.token_ids[:n]), f"target {seq.request_id}")
            checked["target"] += 1
        if fresh_draft is not None:
            proposer = eng.strategy.proposer
            proposer.kv.check_integrity()
            for state in proposer._states.values():
                n = state.num_computed_tokens
                if n:
                    assert_same(cached_kv(proposer.executor, proposer.kv.get_block_ids(state), n),
                                fresh_kv(fresh_draft, state.token_ids[:n]), "draft")
                    checked["draft"] += 1

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    run_engine(engine, prompts, params, check=check)
    assert engine.kv.pool.num_used_blocks == 0
    assert checked["target"] > 20
    stats = engine.stats().spec.total
    assert 0 < stats.num_accepted < stats.num_proposed, "want a mix of accepts and rejects"
    if kind.startswith("oracle"):
        assert engine.scheduler.num_preemptions > 0
    if fresh_draft is not None:
        assert checked["draft"] > 20 and engine.strategy.proposer.kv.pool.num_used_blocks == 0
