"""Draft dirs: save/load round trips give identical outputs for every kind, draftsmith.json records
provenance, and load-time checks refuse a draft built for another target, naming both sides' values."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaForCausalLM

from draftsmith.drafts.eagle import EagleDraft
from draftsmith.drafts.eagle3 import Eagle3Draft, build_reduced_vocab
from draftsmith.drafts.io import ExpectedTarget, load_draft, read_draft_meta, save_draft
from draftsmith.drafts.medusa import MedusaDraft
from draftsmith.drafts.standalone import StandaloneDraft
from tiny_models import save_tiny_model, tiny_model

V, D = 128, 64
TARGET = dict(hidden_size=D, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, vocab_size=V)


def make_draft(kind: str):
    torch.manual_seed(0)
    if kind == "standalone":
        return StandaloneDraft.from_target_config(TARGET, num_layers=2)
    if kind == "standalone_tied":
        return StandaloneDraft.from_target_config({**TARGET, "tie_word_embeddings": True}, num_layers=1)
    if kind == "medusa":
        draft = MedusaDraft.from_target_config(TARGET, num_heads=3, num_layers=2)
        for p in draft.parameters():
            torch.nn.init.normal_(p, std=0.1)  # non-trivial weights so round trips are meaningful
        return draft
    if kind == "medusa_own_heads":
        return MedusaDraft.from_target_config(TARGET, num_heads=2, shared_lm_head=False)
    if kind == "eagle":
        return EagleDraft.from_target_config(TARGET, fc_bias=True)
    draft = Eagle3Draft.from_target_config(TARGET, draft_vocab_size=40)
    draft.set_vocab_map(*build_reduced_vocab(torch.randint(0, 50, (V,)), 40))
    return draft


def run(draft, seed: int = 1) -> torch.Tensor:
    """One deterministic batch forward through the kind's training API."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (2, 7), generator=g)
    with torch.no_grad():
        if isinstance(draft, StandaloneDraft):
            return draft.forward_batch(ids)
        if isinstance(draft, MedusaDraft):
            return draft(torch.randn(2, 7, D, generator=g))
        if isinstance(draft, EagleDraft):
            return draft.forward_batch(ids, torch.randn(2, 7, D, generator=g))[1]
        return draft.forward_batch(ids, torch.randn(2, 7, 3 * D, generator=g))[1]


KINDS = ["standalone", "standalone_tied", "medusa", "medusa_own_heads", "eagle", "eagle3"]


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_identical_outputs(kind, tmp_path):
    """save_draft -> load_draft reproduces every tensor and the outputs bit for bit; frozen target copies
    stay frozen; draftsmith.json carries kind, fingerprint, data hash, metrics and version."""
    draft = make_draft(kind).eval()
    out = save_draft(draft, tmp_path / "d", target_fingerprint="abc123", data_manifest_hash="data42", metrics={"alpha": 0.5})
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "draftsmith.json"}
    loaded = load_draft(out, expected_target=ExpectedTarget("abc123", V, D))
    assert loaded.kind == draft.kind
    assert torch.equal(run(loaded.model), run(draft))
    for name, tensor in draft.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[name], tensor), name
    frozen = {n for n, p in draft.named_parameters() if not p.requires_grad}
    assert frozen == {n for n, p in loaded.model.named_parameters() if not p.requires_grad}
    meta = json.loads((out / "draftsmith.json").read_text())
    assert meta["kind"] == draft.kind and meta["target_fingerprint"] == "abc123"
    assert meta["data_manifest_hash"] == "data42" and meta["metrics"] == {"alpha": 0.5} and "draftsmith_version" in meta


@pytest.mark.parametrize("tied", [False, True])
def test_standalone_dir_is_a_plain_hf_checkpoint(tied, tmp_path):
    """A saved standalone draft loads with transformers' LlamaForCausalLM.from_pretrained and gives the same logits."""
    draft = make_draft("standalone_tied" if tied else "standalone").eval()
    save_draft(draft, tmp_path, target_fingerprint="fp")
    hf = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(0, V, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, draft.forward_batch(ids), atol=1e-5, rtol=1e-5)


def test_plain_hf_dir_without_metadata_loads_as_standalone(tmp_path):
    """A user's HF Llama dir with no draftsmith.json is an unfingerprinted standalone draft."""
    hf = tiny_model("llama", **{**TARGET, "num_hidden_layers": 1})
    hf.save_pretrained(tmp_path)
    loaded = load_draft(tmp_path, expected_target=ExpectedTarget("fp", V, D))
    assert loaded.kind == "standalone" and loaded.meta.target_fingerprint is None
    ids = torch.randint(0, V, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(loaded.model.forward_batch(ids), hf(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle3"])
def test_feature_draft_mismatches_raise_naming_both_sides(kind, tmp_path):
    """Vocab size, hidden size and fingerprint mismatches are ValueErrors that name the draft's and the target's values."""
    save_draft(make_draft(kind), tmp_path, target_fingerprint="aaaa")
    with pytest.raises(ValueError, match=rf"vocab_size={V}.*vocab_size=200"):
        load_draft(tmp_path, expected_target=ExpectedTarget("aaaa", 200, D))
    with pytest.raises(ValueError, match=rf"hidden_size={D}.*hidden_size=96"):
        load_draft(tmp_path, expected_target=ExpectedTarget("aaaa", V, 96))
    with pytest.raises(ValueError, match="fingerprint aaaa.*fingerprint is bbbb"):
        load_draft(tmp_path, expected_target=ExpectedTarget("bbbb", V, D))


def test_standalone_fingerprint_mismatch_warns_but_vocab_mismatch_errors(tmp_path):
    """A standalone draft for another target still verifies exactly (warning); a different vocabulary cannot."""
    save_draft(make_draft("standalone"), tmp_path, target_fingerprint="aaaa")
    with pytest.warns(UserWarning, match="fingerprint aaaa"):
        load_draft(tmp_path, expected_target=ExpectedTarget("bbbb", V, 4096))  # hidden size is free for standalone
    with pytest.raises(ValueError, match="fingerprint"):
        load_draft(tmp_path, expected_target=ExpectedTarget("bbbb", V, D), strict_fingerprint=True)
    with pytest.raises(ValueError, match="vocab_size"):
        load_draft(tmp_path, expected_target=ExpectedTarget("aaaa", V + 1, D))


def test_expected_target_from_model_dir_uses_identity_fingerprint(tmp_path):
    """Passing the target's model dir computes its fingerprint via drafts.identity and checks against it."""
    from draftsmith.drafts.identity import target_fingerprint

    save_tiny_model(tmp_path / "target", **TARGET)
    fp = target_fingerprint(tmp_path / "target")
    save_draft(make_draft("eagle"), tmp_path / "ok", target_fingerprint=fp)
    save_draft(make_draft("eagle"), tmp_path / "other", target_fingerprint="0" * len(fp))
    assert load_draft(tmp_path / "ok", expected_target=tmp_path / "target").kind == "eagle"
    with pytest.raises(ValueError, match=fp):
        load_draft(tmp_path / "other", expected_target=tmp_path / "target")


def test_bad_dirs_raise_naming_the_file(tmp_path):
    """Not-a-draft dirs, unknown kinds, kind disagreement between files and missing weights name the file."""
    with pytest.raises(ValueError, match="not a draft dir"):
        load_draft(tmp_path)
    out = save_draft(make_draft("eagle"), tmp_path / "d")
    meta = json.loads((out / "draftsmith.json").read_text())
    (out / "draftsmith.json").write_text(json.dumps({**meta, "kind": "eagle3"}))
    with pytest.raises(ValueError, match="draftsmith.json says kind='eagle3'"):
        load_draft(out)
    (out / "draftsmith.json").write_text(json.dumps({**meta, "kind": "hydra"}))
    with pytest.raises(ValueError, match="kind 'hydra'"):
        read_draft_meta(out)
    (out / "draftsmith.json").write_text(json.dumps(meta))
    (out / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="model.safetensors"):
        load_draft(out)
    with pytest.raises(ValueError, match="kind='medusa'"):
        save_draft(make_draft("eagle"), tmp_path / "x", kind="medusa")
