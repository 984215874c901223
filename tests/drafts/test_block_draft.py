"""The block-parallel draft: speculators DFlash export round trip (bit-identical), its bad-input lines, and the
proposer's cost: one draft forward per round whatever K is."""
from __future__ import annotations

import json

import pytest
import torch

from draftsmith.drafts.block import BlockDraft
from draftsmith.drafts.export import export_draft, load_exported
from draftsmith.drafts.io import load_draft
from draftsmith.kernels.layers.checkpoint import load_target_embed_and_head
from draftsmith.serve_eval.engine import EngineConfig, LLMEngine, SamplingParams
from draftsmith.serve_eval.speculative.config import SpecConfig
from spec_helpers import feature_draft, make_llama, run_engine, workload

ENGINE = dict(block_size=4, max_model_len=96, prefill_chunk_size=16, max_num_batched_tokens=96, num_gpu_blocks=200)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("block")
    target = make_llama(root / "target", layers=4, seed=0)
    init = lambda d: d.init_from_target(*load_target_embed_and_head(target))  # noqa: E731
    draft = feature_draft("block", target, root / "block", init=init, block_opts={"block_size": 9})
    return root, target, draft


def test_speculators_export_round_trip_is_bit_identical(world):
    """Exported to the speculators DFlash layout and read back, the module computes the same bits."""
    root, target, src = world
    out = export_draft(src, "speculators", root / "dflash", verifier=str(target), num_speculative_tokens=8)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["architectures"] == ["DFlashDraftModel"]
    assert config["block_size"] == 9 and config["speculators_config"]["algorithm"] == "dflash"
    assert config["aux_hidden_state_layer_ids"] == [1, 2, 3]
    ours, theirs = load_draft(src).model, load_exported(out)
    assert isinstance(theirs, BlockDraft)
    torch.manual_seed(0)
    ids, aux = torch.randint(0, 128, (2, 24)), torch.randn(2, 24, 3 * 64)
    anchors = torch.tensor([[3, 11, 17], [0, 9, 14]])
    with torch.no_grad():
        assert torch.equal(ours.anchor_forward(ids, aux, anchors), theirs.anchor_forward(ids, aux, anchors))


def test_bad_input_block_larger_than_trained(world):
    _, target, draft = world
    with pytest.raises(ValueError, match=r"K=9 is larger than the draft was trained for \(at most block_size - 1 = 8\)"):
        LLMEngine(EngineConfig(str(target), **ENGINE), speculative=SpecConfig("block", draft_path=str(draft),
                                                                              num_speculative_tokens=9))


def test_export_refuses_the_final_hidden_as_an_aux_layer_an_engine_cannot_capture(world, tmp_path):
    """A draft on layer L (the final norm's output) serves in our engine; vLLM/SGLang capture layer inputs 0..L-1, so
    its speculators export stops naming the layers and the way to a servable draft."""
    from draftsmith.drafts.io import save_draft
    from draftsmith.drafts.identity import target_fingerprint

    _, target, _ = world
    draft = BlockDraft.from_target_config(target, aux_layers=[1, 2, 4])   # the target has 4 layers
    save_draft(draft, tmp_path / "final", "block", target_fingerprint(target))
    with pytest.raises(ValueError, match=r"aux layer ids \[4\]: .* decoder layers 0..3; .*aux_layers=\[2,2,3\]"):
        export_draft(tmp_path / "final", "speculators", tmp_path / "out", verifier=str(target), num_speculative_tokens=4)


def test_bad_input_aux_layers_the_target_lacks(world, tmp_path):
    _, target, _ = world
    with pytest.raises(ValueError, match=r"aux_layers \[1, 2, 7\]: \[7\] outside 0..4 \(the target has 4 layers\)"):
        BlockDraft.from_target_config(target, aux_layers=[1, 2, 7])
    # a draft dir claiming such layers is refused when the engine loads it, before any request
    path = feature_draft("block", target, tmp_path / "bad")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "aux_layers": [1, 2, 7]}))
    with pytest.raises(ValueError, match=r"\[7\] outside 0..4"):
        LLMEngine(EngineConfig(str(target), **ENGINE), speculative=SpecConfig("block", draft_path=str(path)))


def test_bad_input_mask_count_differs_from_config(world, tmp_path):
    _, target, _ = world
    path = feature_draft("block", target, tmp_path / "masks", block_opts={"block_size": 5})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_mask_tokens": 1}))
    with pytest.raises(ValueError, match=r"mask_embeddings \(4, 64\) do not match the config's num_mask_tokens=1"):
        load_draft(path)


@pytest.mark.parametrize("k", [4, 8])
def test_one_draft_forward_per_round_whatever_k(world, k):
    """Batch 1, greedy: every propose call runs exactly one block forward (all draft layers once, over a block
    of fixed width); its rounds verify chains of K tokens; the draft pool is empty afterwards."""
    _, target, draft = world
    engine = LLMEngine(EngineConfig(str(target), **ENGINE),
                       speculative=SpecConfig("block", draft_path=str(draft), num_speculative_tokens=k))
    proposer = engine.strategy.proposer
    calls, proposed = [], []
    proposer.draft.register_forward_hook(lambda _m, args, _out: calls.append(args[0].shape[0]))  # block tokens
    inner = proposer.propose

    def counting(seqs, num_tokens, features=None):
        out = inner(seqs, num_tokens, features)
        proposed.extend(p.num_tokens for p in out if p.num_tokens)
        return out

    proposer.propose = counting  # instance attribute: the strategy calls self.proposer.propose
    prompts, _ = workload(1, seed=3, max_len=12)
    run_engine(engine, prompts, [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)])
    total = engine.stats().spec.total
    # batch 1: one draft forward per non-empty proposal (the strategy may still clamp a proposal's K)
    assert total.num_rounds > 0 and len(calls) == len(proposed) and max(proposed) == k
    assert set(calls) == {proposer.draft.config.block_size}  # the same block whatever K
    assert len(total.acceptance_by_position) <= k
    assert proposer.cache.manager.pool.num_used_blocks == 0


def test_plan_prices_the_block_draft_as_one_forward_per_round():
    """`draftsmith plan`: EAGLE's draft cost grows with K (K steps), the block draft's does not (one forward)."""
    from draftsmith.serve_eval.plan.estimate import DraftOptions, Hardware, TargetSpec, Workload, make_plan

    target = TargetSpec(params=8e9, num_layers=32, num_kv_heads=8, head_dim=128, hidden_size=4096, vocab_size=128256)
    rows = {k: {r.strategy: r for r in make_plan(target, Hardware(80.0, 3.35), Workload(), DraftOptions(K=k)).strategies}
            for k in (4, 8)}
    assert rows[8]["block"].draft_cost_ms == pytest.approx(rows[4]["block"].draft_cost_ms)
    assert rows[8]["eagle"].draft_cost_ms == pytest.approx(2 * rows[4]["eagle"].draft_cost_ms)
    assert rows[4]["block"].tokens_per_call == pytest.approx(1 + 4 * 0.72)


def test_pipeline_refuses_an_eval_k_above_the_block_before_any_stage():
    """The embedded profile plans the block draft; a block shorter than the eval's K stops the job at the checks."""
    from draftsmith.train.config import compose
    from draftsmith.train.pipeline.run import check_stage_configs
    from draftsmith.train.pipeline.distill import planned_kinds

    cfg = compose([])
    assert "block" in planned_kinds(cfg)
    check_stage_configs(cfg)
    # the embedded eval runs the block draft at its own K (pipeline.eval.num_speculative_tokens_of.block = [8])
    with pytest.raises(ValueError, match=r"block_size: 5 proposes at most 4 tokens, but the eval asks for K=8"):
        check_stage_configs(compose(["pipeline.drafts.block.block_size=5"]))


def test_layers_warm_start_from_the_targets_last_layers(world):
    """init_layers_from_target copies the target's last decoder layers and final norm; a bad layer list or a
    checkpoint without a named weight is one line."""
    from draftsmith.kernels.layers.checkpoint import read_state_dict

    _, target, _ = world
    state = read_state_dict(target)  # a 4-layer target
    draft = BlockDraft.from_target_config(target, aux_layers=[1, 2, 3], num_layers=2, block_size=5)
    draft.init_layers_from_target(state)
    for dst, src in ((0, 2), (1, 3)):
        for name, tensor in draft.layers[dst].state_dict().items():
            assert torch.equal(tensor, state[f"model.layers.{src}.{name}"]), name
    assert torch.equal(draft.norm.weight, state["model.norm.weight"])
    with pytest.raises(ValueError, match=r"block draft init: layer ids \[3\] must name 2 of the target's 4 layers"):
        draft.init_layers_from_target(state, layer_ids=[3])
    with pytest.raises(ValueError, match=r"the target has no weight 'model.norm.weight'"):
        draft.init_layers_from_target({k: v for k, v in state.items() if k != "model.norm.weight"})
