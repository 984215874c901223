"""Greedy exactness of speculative decoding inside the engine: for every proposer (n-gram, standalone,
scripted chain/tree oracles, and Medusa / EAGLE / EAGLE-3 / block with untrained drafts when their proposers
are installed), batch 1 and 8, with preemption (recompute and swap, tiny block budget) and prefix
caching on, the output equals non-speculative greedy decoding token for token (fp32). On the CPU in CI;
DRAFTSMITH_TEST_DEVICE=cuda runs them on a GPU."""
from __future__ import annotations

import shutil

import pytest

from draftsmith.serve_eval.engine import EngineConfig, LLMEngine, SamplingParams
from draftsmith.serve_eval.speculative.config import SpecConfig
from draftsmith.serve_eval.speculative.strategy import SpeculativeStrategy
from spec_helpers import (TEST_DEVICE, OracleProposer, feature_draft, greedy_reference, make_llama,
                          proposer_available, run_engine, workload)

ENGINE = dict(block_size=4, max_model_len=96, prefill_chunk_size=16, max_num_batched_tokens=96, device=TEST_DEVICE)
SMALL_POOL = dict(num_gpu_blocks=30, swap_threshold_tokens=40, num_cpu_blocks=64)
BIG_POOL = dict(num_gpu_blocks=400)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_greedy")
    target = make_llama(root / "target", layers=4, seed=0)
    draft = make_llama(root / "draft", hidden=32, layers=1, seed=1)
    self_draft = root / "self_draft"  # the target itself as a draft: high acceptance, full-accept path
    shutil.copytree(target, self_draft)
    out = {"target": target, "standalone": draft, "self": self_draft}
    for kind in ("medusa", "eagle", "eagle3"):
        if proposer_available(kind):
            out[kind] = feature_draft(kind, target, root / kind)
    if proposer_available("block"):  # the target's embedding and head: its blocks are not pure noise
        from draftsmith.kernels.layers.checkpoint import load_target_embed_and_head

        out["block"] = feature_draft("block", target, root / "block", block_opts={"block_size": 5},
                                     init=lambda d: d.init_from_target(*load_target_embed_and_head(target)))
    return out


@pytest.fixture(scope="module")
def reference(models):
    cache = {}

    def get(n, seed):
        if (n, seed) not in cache:
            prompts, lengths = workload(n, seed, shared_prefix=8, max_len=14, max_out=24)
            cache[(n, seed)] = (prompts, lengths, greedy_reference(models["target"], prompts, lengths,
                                                                   **ENGINE, **BIG_POOL))
        return cache[(n, seed)]
    return get


CASES = [
    ("ngram", {}),
    ("standalone", {}),
    ("self", {}),
    ("oracle-chain", {}),
    ("oracle-tree", {}),
    ("medusa", {}),
    ("medusa", {"tree": "static", "tree_branching": [2, 2], "max_draft_nodes": 6}),
    ("eagle", {}),
    ("eagle", {"tree": "dynamic", "tree_top_k": 2, "tree_depth": 3, "max_draft_nodes": 8}),
    ("eagle3", {}),
    ("eagle3", {"tree": "dynamic", "tree_top_k": 2, "tree_depth": 3, "max_draft_nodes": 8}),
    ("block", {}),
]
FEATURE_METHODS = ("medusa", "eagle", "eagle3", "block")


def build_engine(models, method, extra, pool, references=None, prompts=None):
    cfg = EngineConfig(str(models["target"]), **ENGINE, **pool)
    if method.startswith("oracle"):
        proposer = OracleProposer(references, prompts, tree=method.endswith("tree"), seed=3)
        spec = SpecConfig("ngram", num_speculative_tokens=3,
                          **({"tree": "static", "tree_branching": [3, 3], "max_draft_nodes": 12}
                             if method.endswith("tree") else {}))
        return LLMEngine(cfg, strategy=SpeculativeStrategy(spec, proposer))
    if method in FEATURE_METHODS and method not in models:
        pytest.skip(f"{method} proposer not installed yet")
    draft = None if method == "ngram" else str(models[method])
    real = "standalone" if method == "self" else method
    return LLMEngine(cfg, speculative=SpecConfig(real, draft_path=draft, num_speculative_tokens=3, **extra))


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("method,extra", CASES, ids=[f"{m}-{e.get('tree', 'chain')}" if m in FEATURE_METHODS else m for m, e in CASES])
def test_greedy_equals_non_speculative(models, reference, method, extra, batch):
    """Speculative greedy output == plain greedy output for every request; no block leaks; the pool
    stays consistent after every step (target and, for the standalone draft, the draft pool)."""
    prompts, lengths, ref = reference(batch, seed=batch)
    pool = SMALL_POOL if batch > 1 else BIG_POOL
    ids = [f"r{i}" for i in range(batch)]
    engine = build_engine(models, method, extra, pool, ref, dict(zip(ids, prompts)))

    def check(eng):
        eng.kv.check_integrity()
        draft_kv = getattr(eng.strategy.proposer, "kv", None)
        if draft_kv is not None:
            draft_kv.check_integrity()

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    outs = run_engine(engine, prompts, params, check=check)
    for rid in ids:
        assert outs[rid].output_token_ids == ref[rid], f"{method}: request {rid} diverged"
    assert engine.kv.pool.num_used_blocks == 0
    draft_kv = getattr(engine.strategy.proposer, "kv", None)
    if draft_kv is not None:
        assert draft_kv.pool.num_used_blocks == 0, "draft blocks leaked"
    stats = engine.stats().spec
    if batch > 1:
        assert engine.scheduler.num_preemptions > 0, "the small pool should force preemption"
    if method in ("self", "oracle-chain", "oracle-tree"):
        assert stats.total.num_accepted > 0
    if method == "self":  # the target as its own draft accepts everything it proposes
        assert stats.total.alpha == 1.0


def test_the_standalone_drafts_steps_run_in_one_c_call(models, reference, monkeypatch):
    """With every proposing request greedy or sampled at a plain temperature, a round's catch-up and its K - 1
    draft decode steps are one draft_decode call in C, so the draft runs no forward of its own (but for a first
    catch-up longer than LOOP_CATCH_UP rows: the prompt); greedy output is still plain greedy decoding's. A top-p
    request's round runs its forward and steps in Python (logits_to_probs holds the filters)."""
    from draftsmith.kernels.layers.native_draft_loop import LOOP_CATCH_UP

    prompts, lengths, ref = reference(1, seed=1)
    engine = build_engine(models, "standalone", {}, BIG_POOL)
    executor = engine.strategy.proposer.executor
    if executor.model.draft_loop() is None:
        pytest.skip("the native CPU kernels do not serve this draft here")
    calls = {"forward": 0, "loop": 0}
    forward, loop = executor.forward, executor.draft_decode

    def counted(name, fn):
        return lambda *a, **k: calls.__setitem__(name, calls[name] + 1) or fn(*a, **k)

    monkeypatch.setattr(executor, "forward", counted("forward", forward))
    monkeypatch.setattr(executor, "draft_decode", counted("loop", loop))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    outs = run_engine(engine, prompts, params)
    assert outs["r0"].output_token_ids == ref["r0"]
    rounds = engine.stats().spec.total.num_rounds
    prompt_forward = int(len(prompts[0]) + 1 > LOOP_CATCH_UP)   # the first catch-up: the prompt and its first token
    assert calls["forward"] == prompt_forward and calls["loop"] == rounds + prompt_forward
    before = engine.stats().spec.total.num_rounds
    calls.update(forward=0, loop=0)
    run_engine(engine, prompts, [SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=0)])
    rounds = engine.stats().spec.total.num_rounds - before
    assert calls["forward"] == prompt_forward and calls["loop"] == rounds + prompt_forward
    calls.update(forward=0, loop=0)
    run_engine(engine, prompts, [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, ignore_eos=True, seed=0)])
    assert calls["loop"] == 0 and calls["forward"] > 0


MIN_TOKENS_CASES = [c for c in CASES if c[0] in ("standalone", "self", "oracle-tree", "block")
                    or (c[0] in ("medusa", "eagle") and c[1])]


@pytest.mark.parametrize("method,extra", MIN_TOKENS_CASES,
                         ids=[f"{m}-{e.get('tree', 'chain')}" for m, e in MIN_TOKENS_CASES])
def test_min_tokens_greedy_equals_non_speculative(models, reference, method, extra):
    """With min_tokens, the stop tokens the greedy paths emit early are masked on every verified row below it (by
    depth, trees included), so speculative output is still plain decoding's token for token: drafts that propose a
    masked token (the self draft proposes the unmasked argmax) are rejected there."""
    prompts, lengths, ref = reference(8, seed=8)
    stops = sorted({toks[1] for toks in ref.values() if len(toks) > 1})[:6]
    params = [SamplingParams(temperature=0, max_tokens=n, min_tokens=n // 2, stop_token_ids=stops) for n in lengths]
    plain = run_engine(LLMEngine(EngineConfig(str(models["target"]), **ENGINE, **BIG_POOL)), prompts, params)
    ids = [f"r{i}" for i in range(len(prompts))]
    engine = build_engine(models, method, extra, BIG_POOL, ref, dict(zip(ids, prompts)))
    outs = run_engine(engine, prompts, params)
    assert any(len(plain[r].output_token_ids) < n for r, n in zip(ids, lengths)), "no request stopped early"
    assert any(set(plain[r].output_token_ids[:n // 2]) != set(ref[r][:n // 2]) for r, n in zip(ids, lengths)), \
        "min_tokens changed no greedy path"
    for rid in ids:
        assert outs[rid].output_token_ids == plain[rid].output_token_ids, f"{method}: request {rid} diverged"
    assert engine.kv.pool.num_used_blocks == 0
