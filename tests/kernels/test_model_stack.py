"""One model stack (kernels.layers) for targets and drafts: a yarn-scaled target is served, every draft kind
(drafts.kinds.KIND_NAMES) is built for it and runs (training form and serving form agree), and greedy
speculative decoding with each kind equals plain greedy decoding token for token (fp32), with positions past
the original context. The engine's target is the same CausalLM class as the standalone draft, fused without a
second copy of its weights."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaForCausalLM

from draftsmith.drafts.block import BlockDraft
from draftsmith.drafts.common import causal_attn_fn
from draftsmith.drafts.eagle import EagleDraft
from draftsmith.drafts.eagle3 import Eagle3Draft
from draftsmith.drafts.identity import target_fingerprint
from draftsmith.drafts.io import save_draft
from draftsmith.drafts.kinds import KIND_NAMES
from draftsmith.drafts.medusa import MedusaDraft
from draftsmith.drafts.standalone import StandaloneDraft
from draftsmith.kernels.layers.causal_lm import CausalLM
from draftsmith.kernels.layers.checkpoint import load_target_embed_and_head
from draftsmith.serve_eval.engine import EngineConfig, LLMEngine, SamplingParams
from draftsmith.serve_eval.engine.model_executor import ModelExecutor
from draftsmith.serve_eval.speculative.config import SpecConfig
from spec_helpers import feature_draft, greedy_reference, run_engine, workload

V, D, L = 128, 64, 4
ENGINE = dict(block_size=4, max_model_len=120, prefill_chunk_size=32, max_num_batched_tokens=128, num_gpu_blocks=400)
KINDS = KIND_NAMES  # every registered kind: a new one fails here until build() knows it
AUX_LAYERS = [1, 2, 3]  # distinct target layers of the 4-layer target (EAGLE-3, block)


@pytest.fixture(scope="module")
def target(family_checkpoint):
    """The yarn Llama (factor 4 over 32 original positions, 128 served) and its dir."""
    path = family_checkpoint("llama-yarn", vocab_size=V, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=L,
                       max_position_embeddings=128, initializer_range=0.1, eos_token_id=V - 1, bos_token_id=0,
                       pad_token_id=0)
    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), path


def build(kind: str, target_dir):
    """An untrained draft of `kind` for the target, from the target's config alone."""
    torch.manual_seed(1)
    if kind == "standalone":
        return StandaloneDraft.from_target_config(target_dir, num_layers=1)
    if kind == "medusa":
        return MedusaDraft.from_target_config(target_dir, num_heads=3)
    if kind == "eagle":
        return EagleDraft.from_target_config(target_dir)
    if kind == "eagle3":
        return Eagle3Draft.from_target_config(target_dir, aux_layers=AUX_LAYERS)
    if kind == "block":
        draft = BlockDraft.from_target_config(target_dir, aux_layers=AUX_LAYERS)
        draft.init_from_target(*load_target_embed_and_head(target_dir))  # its blocks are not pure noise
        return draft
    raise AssertionError(f"build: no test recipe for draft kind {kind!r}")


def training_forward(kind: str, draft, ids: torch.Tensor) -> torch.Tensor:
    """Logits of the training API over a [B, S] batch (random features stand in for the target's)."""
    B, S = ids.shape
    gen = torch.Generator().manual_seed(2)
    if kind == "standalone":
        return draft.forward_batch(ids)
    if kind == "medusa":
        return draft(torch.randn(B, S, D, generator=gen))
    if kind == "eagle":
        return draft.forward_batch(ids, torch.randn(B, S, D, generator=gen))[1]
    aux = torch.randn(B, S, len(AUX_LAYERS) * D, generator=gen)
    if kind == "block":  # blocks rooted at anchors, positions up to S - 1 + block_size (past 32)
        anchors = torch.tensor([[0, S // 3, S - draft.config.block_size]] * B)
        return draft.anchor_forward(ids, aux, anchors)
    return draft.forward_batch(ids, aux)[1]


def test_standalone_stack_matches_hf_under_yarn(target):
    """The shared CausalLM with the target's own yarn weights gives HF's logits past the original context."""
    model, _ = target
    ours = StandaloneDraft.from_hf(model).eval()
    assert ours.config.decoder.rope_scaling["rope_type"] == "yarn"
    ids = torch.randint(0, V, (2, 60), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(ours.forward_batch(ids), model(ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_every_draft_kind_builds_and_runs_for_a_yarn_target(target, kind):
    """Each kind takes the target's yarn rope, trains (a backward pass) and its serving form (fused, packed
    projections, as the proposers run it) gives the training form's logits."""
    _, target_dir = target
    draft = build(kind, target_dir)
    if kind != "medusa":
        assert draft.config.decoder.rope_scaling["rope_type"] == "yarn"
    ids = torch.randint(0, V, (2, 48), generator=torch.Generator().manual_seed(4))
    logits = training_forward(kind, draft, ids)
    logits.float().logsumexp(-1).mean().backward()
    assert any(p.grad is not None for p in draft.parameters())
    with torch.no_grad():
        served = copy.deepcopy(draft).eval().to_serving_()
        torch.testing.assert_close(training_forward(kind, served, ids), training_forward(kind, draft.eval(), ids),
                                   atol=1e-5, rtol=1e-5)


def test_eagle_serving_form_runs_bf16_packed(target):
    """bf16 serving form (oneDNN-packed where the CPU supports it) tracks the bf16 training form."""
    _, target_dir = target
    draft = build("eagle", target_dir).to(torch.bfloat16).eval()
    B, S = 1, 40
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(5))
    feats = torch.randn(B, S, D, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    positions = torch.arange(S)
    with torch.no_grad():
        ref = draft(ids[0], feats[0], positions, causal_attn_fn(B, S))
        got = copy.deepcopy(draft).to_serving_()(ids[0], feats[0], positions, causal_attn_fn(B, S))
    assert (got.float() - ref.float()).abs().max().item() < 0.1


@pytest.fixture(scope="module")
def drafts(target, tmp_path_factory):
    _, target_dir = target
    root = tmp_path_factory.mktemp("yarn_drafts")
    out = {}
    for kind in KINDS:
        if kind == "eagle3":
            out[kind] = feature_draft(kind, target_dir, root / kind)
        elif kind == "block":
            out[kind] = feature_draft(kind, target_dir, root / kind,
                                      init=lambda d: d.init_from_target(*load_target_embed_and_head(target_dir)))
        else:
            out[kind] = root / kind
            save_draft(build(kind, target_dir), out[kind], kind, target_fingerprint(target_dir))
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_speculation_is_exact_for_a_yarn_target(target, drafts, kind):
    """Every kind speculates on the yarn target and its greedy output equals plain greedy decoding."""
    _, target_dir = target
    prompts, _ = workload(3, seed=7, max_len=30)
    lengths = [40, 24, 33]  # prompt + output run past original_max_position_embeddings = 32
    ref = greedy_reference(target_dir, prompts, lengths, **ENGINE)
    engine = LLMEngine(EngineConfig(str(target_dir), **ENGINE),
                       speculative=SpecConfig(kind, draft_path=str(drafts[kind]), num_speculative_tokens=3))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    outs = run_engine(engine, prompts, params)
    for rid, tokens in ref.items():
        assert outs[rid].output_token_ids == tokens, f"{kind}: request {rid} diverged"
    assert engine.stats().spec.total.num_rounds > 0


def test_engine_target_is_the_shared_causal_lm_fused_in_place(target):
    """The executor runs a kernels.layers CausalLM (the standalone draft's class); its fused q/k/v and gate/up
    matrices hold the module's parameters as views (one copy of the weights), and its logits equal the
    training-form forward of the same weights."""
    model, target_dir = target
    executor = ModelExecutor(target_dir)
    assert isinstance(executor.model, CausalLM) and issubclass(StandaloneDraft, CausalLM)
    layer = executor.model.model.layers[0]
    qkv = layer.serving_ops.attention.args[1].weight  # partial(attend, shape, qkv, o)
    assert layer.self_attn.q_proj.weight.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()
    ids = torch.randint(0, V, (1, 40), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        hidden = executor.model(ids[0], torch.arange(40), causal_attn_fn(1, 40))
        torch.testing.assert_close(executor.model.compute_logits(hidden), model(ids).logits[0], atol=1e-4, rtol=1e-4)
