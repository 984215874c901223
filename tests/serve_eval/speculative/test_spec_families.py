"""Every draft kind builds on a tiny Qwen3, Qwen3-MoE and sliding-window Qwen3 target and speculates exactly:
greedy speculative output == plain greedy output token for token (fp32), chains and trees, with preemption.
The standalone cases run a Llama draft and the target's own family checkpoint as its draft."""
from __future__ import annotations

import shutil

import pytest

from draftsmith.serve_eval.engine import EngineConfig, LLMEngine, SamplingParams
from draftsmith.serve_eval.speculative.config import SpecConfig
from spec_helpers import feature_draft, greedy_reference, make_llama, proposer_available, run_engine, workload
from test_executor import SHAPE, VOCAB

ENGINE = dict(block_size=4, max_model_len=96, prefill_chunk_size=16, max_num_batched_tokens=96)
POOL = dict(num_gpu_blocks=40, swap_threshold_tokens=40, num_cpu_blocks=64)
TARGETS = {  # tiny_models family, fields
    "qwen3": ("qwen3", {}),
    "qwen3_moe": ("qwen3_moe", {"norm_topk_prob": True, "mlp_only_layers": [1]}),
    "qwen3-window": ("qwen3-window", {"max_window_layers": 1}),
}
CASES = [
    ("ngram", {}),
    ("standalone", {}),
    ("self", {}),
    ("medusa", {}),
    ("eagle", {"tree": "dynamic", "tree_top_k": 2, "tree_depth": 3, "max_draft_nodes": 8}),
    ("eagle3", {}),
    ("eagle3", {"tree": "dynamic", "tree_top_k": 2, "tree_depth": 3, "max_draft_nodes": 8}),
    ("block", {}),
]


@pytest.fixture(scope="module", params=list(TARGETS))
def setup(request, tmp_path_factory, family_checkpoint):
    family, extra = TARGETS[request.param]
    target = family_checkpoint(family, shape=SHAPE, initializer_range=0.1, num_hidden_layers=4, **extra)
    root = target.parent
    models = {"target": target, "standalone": make_llama(root / "draft", vocab=VOCAB, hidden=32, layers=1, seed=1)}
    shutil.copytree(target, root / "self")
    models["self"] = root / "self"
    for method in ("medusa", "eagle", "eagle3"):
        if proposer_available(method):
            models[method] = feature_draft(method, target, root / method)
    if proposer_available("block"):
        from draftsmith.kernels.layers.checkpoint import load_target_embed_and_head

        models["block"] = feature_draft("block", target, root / "block", block_opts={"block_size": 5},
                                        init=lambda d: d.init_from_target(*load_target_embed_and_head(target)))
    prompts, lengths = workload(4, seed=3, shared_prefix=6, max_len=12, max_out=20, vocab=VOCAB)
    ref = greedy_reference(target, prompts, lengths, **ENGINE, num_gpu_blocks=400)
    return models, prompts, lengths, ref


@pytest.mark.parametrize("method,extra", CASES, ids=[f"{m}-{e.get('tree', 'chain')}" for m, e in CASES])
def test_greedy_speculation_is_exact(setup, method, extra):
    models, prompts, lengths, ref = setup
    if method not in models and method != "ngram":
        pytest.skip(f"{method} proposer not installed")
    real = "standalone" if method == "self" else method
    draft = None if method == "ngram" else str(models[method])
    engine = LLMEngine(EngineConfig(str(models["target"]), **ENGINE, **POOL),
                       speculative=SpecConfig(real, draft_path=draft, num_speculative_tokens=3, **extra))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    outs = run_engine(engine, prompts, params, check=lambda eng: eng.kv.check_integrity())
    for rid, tokens in ref.items():
        assert outs[rid].output_token_ids == tokens, f"{method}: request {rid} diverged"
    assert engine.kv.pool.num_used_blocks == 0
    if method == "self":
        assert engine.stats().spec.total.alpha == 1.0
