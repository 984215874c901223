"""Draft architectures: exactness against HF Llama, step (serving) API == batch (training) API, TTT unroll ==
serving unroll, reduced vocab maps, config errors, and a tiny training smoke per kind."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith.drafts.common import DenseKVCache
from draftsmith.drafts.eagle import EagleDraft
from draftsmith.drafts.eagle3 import Eagle3Config, Eagle3Draft, build_reduced_vocab, default_aux_layers
from draftsmith.drafts.medusa import MedusaDraft
from draftsmith.drafts.standalone import StandaloneConfig, StandaloneDraft, init_from_target
from draftsmith.kernels.layers.config import DecoderConfig
from tiny_models import tiny_config, tiny_model

V, D, L = 128, 64, 4
TARGET = dict(vocab_size=V, hidden_size=D, intermediate_size=128, num_hidden_layers=L)


def target_config(**kw) -> LlamaConfig:
    return tiny_config("llama", **{**TARGET, **kw})


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    return tiny_model("llama", **TARGET)


def target_features(target, ids):
    with torch.no_grad():
        out = target(ids, output_hidden_states=True)
    return out.hidden_states


# ------------------------------------------------------------------------------------------------ standalone


def test_standalone_matches_hf_llama_with_llama3_rope_and_gqa():
    """Our flattened-token Llama stack (RMSNorm, llama3 rope, GQA, MLP) gives HF's logits to fp32 precision."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
    hf = tiny_model("llama", 1, **{**TARGET, "num_hidden_layers": 2}, rope_scaling=scaling)
    ours = StandaloneDraft.from_hf(hf).eval()
    ids = torch.randint(0, V, (3, 20))
    with torch.no_grad():
        torch.testing.assert_close(ours.forward_batch(ids), hf(ids).logits, atol=1e-5, rtol=1e-5)
    assert set(ours.state_dict()) == set(hf.state_dict())


def test_standalone_step_api_equals_batch_api():
    """A serving unroll (prefill chunk, then one token at a time through a KV cache) equals the batch forward."""
    torch.manual_seed(2)
    draft = StandaloneDraft.from_target_config(target_config(), num_layers=2).eval()
    ids = torch.randint(0, V, (1, 11))
    with torch.no_grad():
        ref = draft.forward_batch(ids)[0]
        cache = DenseKVCache(draft.num_layers)
        chunks = [(0, 5), (5, 6), (6, 7), (7, 11)]
        got = []
        for a, b in chunks:
            hidden = draft(ids[0, a:b], torch.arange(a, b), cache.attn_fns())
            got.append(draft.compute_logits(hidden))
    torch.testing.assert_close(torch.cat(got), ref, atol=1e-5, rtol=1e-5)
    cache.truncate(7)
    assert cache.num_tokens == 7


def test_standalone_from_target_config_and_init_from_target(target):
    """from_target_config keeps vocab/head_dim and shrinks depth; init_from_target copies embeddings, head and
    the chosen layers; a width mismatch is refused naming both shapes."""
    cfg = StandaloneConfig.from_target_config(target.config)
    assert cfg.vocab_size == V and cfg.num_hidden_layers == L // 4 and cfg.decoder.head_dim == target.config.head_dim
    draft = StandaloneDraft(StandaloneConfig.from_target_config(target.config, num_layers=2))
    init_from_target(draft, target.state_dict(), layer_ids=[0, 3])
    sd, td = draft.state_dict(), target.state_dict()
    assert torch.equal(sd["model.embed_tokens.weight"], td["model.embed_tokens.weight"])
    assert torch.equal(sd["model.layers.1.mlp.up_proj.weight"], td["model.layers.3.mlp.up_proj.weight"])
    narrow = StandaloneDraft.from_target_config(target.config, num_layers=1, hidden_size=32)
    assert narrow.config.decoder.num_attention_heads == 2 and narrow.config.decoder.head_dim == 16
    with pytest.raises(ValueError, match=r"\(128, 64\) in the target, \(128, 32\) in the draft"):
        init_from_target(narrow, target.state_dict())


def test_standalone_init_counts_negative_layer_ids_from_the_target_s_last(target):
    draft = StandaloneDraft(StandaloneConfig.from_target_config(target.config, num_layers=1))
    init_from_target(draft, target.state_dict(), layer_ids=[-1])
    assert torch.equal(draft.state_dict()["model.layers.0.self_attn.q_proj.weight"],
                       target.state_dict()[f"model.layers.{L - 1}.self_attn.q_proj.weight"])
    with pytest.raises(ValueError, match=r"init_from_target: layer ids \[4\] must name 1 of the target's 4 layers"):
        init_from_target(draft, target.state_dict(), layer_ids=[L])


def distinct_norms(state: dict) -> dict:
    """The target's weights with random norm weights (a fresh draft's norms are ones, as the tiny target's
    are, so a norm copy would otherwise pass unseen)."""
    gen = torch.Generator().manual_seed(0)
    return {k: (torch.rand(v.shape, generator=gen) + 0.5 if "norm" in k else v.clone()) for k, v in state.items()}


def test_eagle_layer_warm_start_takes_the_target_s_last_layer_and_passes_the_feature_through_fc(target):
    """init_layer_from_target: the decoder layer's weights are the target's last layer's (no input norm to
    take), and fc maps [emb ; f] to f, so the untrained draft runs that layer on the feature it is given."""
    draft = EagleDraft.from_target_config(target.config).eval()
    td = distinct_norms(target.state_dict())
    draft.init_layer_from_target(td)
    for name, tensor in draft.layers[0].state_dict().items():
        assert torch.equal(tensor, td[f"model.layers.{L - 1}.{name}"]), name
    assert "input_layernorm.weight" not in draft.layers[0].state_dict()
    e, f = torch.randn(3, D), torch.randn(3, D)
    torch.testing.assert_close(draft.fc(torch.cat([e, f], dim=-1)), f)
    with pytest.raises(ValueError, match=r"EAGLE init: layer ids \[9\] must name the target's 4 layers"):
        draft.init_layer_from_target(td, layer_id=9)


def test_eagle3_layer_warm_start_reads_the_hidden_half_with_the_target_s_last_layer(target):
    """init_layer_from_target: MLP, o_proj and norms are the target's; q/k/v carry the target's weights on
    the hidden half of their 2d input and zero on the embedding half; fc passes the last aux layer through."""
    draft = Eagle3Draft.from_target_config(target.config).eval()
    td = distinct_norms(target.state_dict())
    draft.init_layer_from_target(td)
    mid, last = draft.midlayer.state_dict(), f"model.layers.{L - 1}"
    for name in ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "self_attn.o_proj.weight",
                 "post_attention_layernorm.weight", "input_layernorm.weight"):
        assert torch.equal(mid[name], td[f"{last}.{name}"]), name
    assert torch.equal(mid["hidden_norm.weight"], td[f"{last}.input_layernorm.weight"])
    for p in "qkv":
        assert torch.equal(mid[f"self_attn.{p}_proj.weight"][:, D:], td[f"{last}.self_attn.{p}_proj.weight"])
        assert not mid[f"self_attn.{p}_proj.weight"][:, :D].any()
    assert torch.equal(draft.norm.weight, td["model.norm.weight"])
    aux = torch.randn(2, 3 * D)
    torch.testing.assert_close(draft.fuse(aux), aux[:, 2 * D:])


# ------------------------------------------------------------------------------------------------ medusa


def test_medusa_shapes_init_and_step_equals_batch(target):
    """Logits are [..., K, V]; zero-initialised residual blocks + the target's head reproduce the target's
    own next-token logits in every head; per-token calls equal the batch call; parameter count is exact."""
    draft = MedusaDraft.from_target_config(target.config, num_heads=3, num_layers=2)
    draft.init_from_target(target.lm_head.weight.detach())
    ids = torch.randint(0, V, (2, 9))
    hidden = target_features(target, ids)[-1]  # final-norm output
    with torch.no_grad():
        logits = draft(hidden)
        assert logits.shape == (2, 9, 3, V)
        for k in range(3):
            torch.testing.assert_close(logits[:, :, k], target(ids).logits, atol=1e-5, rtol=1e-5)
        per_token = torch.stack([draft(hidden[:, t]) for t in range(9)], dim=1)
    torch.testing.assert_close(per_token, logits)
    assert draft.num_parameters(trainable_only=True) == 3 * 2 * (D * D + D)
    assert draft.num_parameters() == 3 * 2 * (D * D + D) + V * D


# ------------------------------------------------------------------------------------------------ eagle


def _serving_unroll(draft, ids, first_hidden, prefix_end, num_steps):
    """Prefill indices 0..prefix_end with teacher inputs, then num_steps on the draft's own hidden (teacher tokens)."""
    cache = DenseKVCache(1)
    attn = cache.attn_fns()[0]
    hidden = draft(ids[: prefix_end + 1], first_hidden[: prefix_end + 1], torch.arange(prefix_end + 1), attn)[-1:]
    outs = [hidden]
    for j in range(1, num_steps):
        pos = prefix_end + j
        hidden = draft(ids[pos : pos + 1], hidden, torch.tensor([pos]), attn)
        outs.append(hidden)
    return outs


def test_eagle_step_api_equals_batch_and_ttt_equals_serving(target):
    """EAGLE-1: cached step-wise forward == batch forward; each training-time-test step at index i equals a
    serving unroll from i that feeds back its own predicted features."""
    torch.manual_seed(3)
    draft = EagleDraft.from_target_config(target.config).eval()
    embed, head = target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach()
    draft.init_from_target(embed, head)
    tokens = torch.randint(0, V, (2, 13))
    feats = target_features(target, tokens)[-1][:, :-1]  # f_0..f_{S-1}
    ids = tokens[:, 1:]  # paired with x_{i+1}
    with torch.no_grad():
        pred, logits = draft.forward_batch(ids, feats)
        assert pred.shape == (2, 12, D) and logits.shape == (2, 12, V)
        cache = DenseKVCache(1)
        steps = [draft(ids[1, a:b], feats[1, a:b], torch.arange(a, b), cache.attn_fns()[0]) for a, b in [(0, 4), (4, 5), (5, 12)]]
        torch.testing.assert_close(torch.cat(steps), pred[1], atol=1e-5, rtol=1e-5)
        ttt = draft.ttt_forward(ids, feats, num_steps=3)
        torch.testing.assert_close(ttt[0][0], pred, atol=1e-5, rtol=1e-5)
        for i in (0, 4, 8):
            serve = _serving_unroll(draft, ids[0], feats[0], i, 3)
            for j in range(3):
                torch.testing.assert_close(ttt[j][0][0, i], serve[j][0], atol=1e-5, rtol=1e-5)
    assert torch.equal(draft.compute_logits(pred), logits)  # logits = target lm_head(feature), no extra norm
    assert not draft.embed_tokens.weight.requires_grad and not draft.lm_head.weight.requires_grad


def test_eagle3_step_api_equals_batch_and_ttt_equals_serving(target):
    """EAGLE-3: fused 3-layer features; cached steps == batch; TTT step j at index i == serving unroll on own
    hidden states (positions i+j), so training trains exactly what serving runs."""
    torch.manual_seed(4)
    cfg = Eagle3Config.from_target_config(target.config)
    assert cfg.aux_layers == default_aux_layers(L) == [2, 2, 1]
    draft = Eagle3Draft(cfg).eval()
    draft.init_from_target(target.model.embed_tokens.weight.detach())
    tokens = torch.randint(0, V, (2, 12))
    hs = target_features(target, tokens)
    aux = torch.cat([hs[i] for i in cfg.aux_layers], dim=-1)[:, :-1]
    ids = tokens[:, 1:]
    with torch.no_grad():
        out, logits = draft.forward_batch(ids, aux)
        assert out.shape == (2, 11, D) and logits.shape == (2, 11, V)
        cache = DenseKVCache(1)
        fused = draft.fuse(aux[0])
        steps = [draft(ids[0, a:b], fused[a:b], torch.arange(a, b), cache.attn_fns()[0]) for a, b in [(0, 1), (1, 6), (6, 11)]]
        torch.testing.assert_close(torch.cat(steps), out[0], atol=1e-5, rtol=1e-5)
        ttt = draft.ttt_forward(ids, aux, num_steps=4)
        torch.testing.assert_close(ttt[0][1], logits, atol=1e-5, rtol=1e-5)
        for i in (0, 3, 7):
            serve = _serving_unroll(draft, ids[1], draft.fuse(aux[1]), i, 4)
            for j in range(4):
                torch.testing.assert_close(ttt[j][0][1, i], serve[j][0], atol=1e-5, rtol=1e-5)


def test_build_reduced_vocab_and_target_mapping():
    """build_reduced_vocab keeps the most frequent ids (ties -> lower id) in ascending order; d2t offsets and
    the t2d mask agree; draft logits scatter into the target vocab with -inf elsewhere."""
    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 2])
    d2t, t2d = build_reduced_vocab(counts, 4)
    kept = torch.arange(4) + d2t
    assert kept.tolist() == [0, 2, 3, 5]
    assert t2d.tolist() == [True, False, True, True, False, True, False, False]
    d2t, t2d = build_reduced_vocab(torch.tensor([1, 1, 1, 1]), 2)  # ties -> lowest ids
    assert (torch.arange(2) + d2t).tolist() == [0, 1]
    with pytest.raises(ValueError, match="size"):
        build_reduced_vocab(counts, 9)

    draft = Eagle3Draft.from_target_config(target_config(), draft_vocab_size=32)
    counts = torch.randint(0, 100, (V,))
    d2t, t2d = build_reduced_vocab(counts, 32)
    draft.set_vocab_map(d2t, t2d)
    draft_logits = torch.randn(3, 32)
    full = draft.to_target_logits(draft_logits)
    assert full.shape == (3, V)
    assert torch.isinf(full[:, ~t2d]).all()
    torch.testing.assert_close(full[:, t2d], draft_logits)  # ascending target ids == draft id order
    assert torch.equal(draft.draft_to_target_ids(torch.tensor([0, 31])), torch.nonzero(t2d)[[0, -1], 0])
    with pytest.raises(ValueError, match="t2d"):
        draft.set_vocab_map(d2t, ~t2d)


def test_config_errors_name_the_field():
    """Bad configs raise ValueError naming the field and the offending values."""
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        DecoderConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=3, head_dim=16, intermediate_size=8)
    with pytest.raises(ValueError, match="aux_layers"):
        Eagle3Config.from_target_config(target_config(), aux_layers=[1, 2, 9])
    with pytest.raises(ValueError, match="draft_vocab_size"):
        Eagle3Config.from_target_config(target_config(), draft_vocab_size=V + 1)
    with pytest.raises(ValueError, match="hidden_size"):
        EagleDraft.from_target_config(target_config(), hidden_size=32)


# ------------------------------------------------------------------------------------------------ training smoke


def _train(params, loss_fn, steps=30, lr=3e-3):
    opt = torch.optim.Adam([p for p in params if p.requires_grad], lr=lr)
    first = None
    for _ in range(steps):
        loss = loss_fn()
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    return first, loss_fn().item()


@pytest.mark.parametrize("kind", ["standalone", "medusa", "eagle", "eagle3"])
def test_training_smoke_reduces_loss(kind, target):
    """A few Adam steps on one fixed random batch lower each draft kind's loss (gradients reach the trainable
    weights; frozen target copies stay untouched)."""
    torch.manual_seed(5)
    tokens = torch.randint(0, V, (4, 16))
    hs = target_features(target, tokens)
    ce = torch.nn.functional.cross_entropy
    if kind == "standalone":
        draft = StandaloneDraft.from_target_config(target.config, num_layers=1)
        loss_fn = lambda: ce(draft.forward_batch(tokens[:, :-1]).reshape(-1, V), tokens[:, 1:].reshape(-1))
    elif kind == "medusa":
        draft = MedusaDraft.from_target_config(target.config, num_heads=2)
        draft.init_from_target(target.lm_head.weight.detach())
        loss_fn = lambda: ce(draft(hs[-1][:, :-3])[:, :, 1].reshape(-1, V), tokens[:, 3:].reshape(-1))
    elif kind == "eagle":
        draft = EagleDraft.from_target_config(target.config)
        draft.init_from_target(target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach())
        feats = hs[-1]

        def loss_fn():
            pred, logits = draft.forward_batch(tokens[:, 1:-1], feats[:, :-2])
            return torch.nn.functional.smooth_l1_loss(pred, feats[:, 1:-1]) + 0.1 * ce(logits.reshape(-1, V), tokens[:, 2:].reshape(-1))
    else:
        draft = Eagle3Draft.from_target_config(target.config)
        draft.init_from_target(target.model.embed_tokens.weight.detach())
        aux = torch.cat([hs[i] for i in draft.config.aux_layers], dim=-1)

        def loss_fn():
            _, logits = draft.forward_batch(tokens[:, 1:-1], aux[:, :-2])
            return ce(logits.reshape(-1, V), tokens[:, 2:].reshape(-1))

    frozen = {n: p.detach().clone() for n, p in draft.named_parameters() if not p.requires_grad}
    first, last = _train(list(draft.parameters()), loss_fn)
    assert last < 0.9 * first, (first, last)
    for name, before in frozen.items():
        assert torch.equal(dict(draft.named_parameters())[name], before), name
