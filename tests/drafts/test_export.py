"""Exported layouts (vLLM EAGLE-1, vLLM speculators Eagle3, SGLang Eagle3, Medusa, HF): field and weight names other engines read,
and each layout read back into our modules gives identical outputs."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig

from draftsmith.drafts.eagle import EagleDraft
from draftsmith.drafts.eagle3 import Eagle3Draft, build_reduced_vocab
from draftsmith.drafts.export import detect_format, export_draft, load_exported, main
from draftsmith.drafts.io import save_draft
from draftsmith.drafts.medusa import MedusaDraft
from draftsmith.drafts.standalone import StandaloneDraft

V, D = 128, 64
TARGET = dict(hidden_size=D, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, vocab_size=V)


@pytest.fixture(scope="module")
def target_dir(family_checkpoint):
    return family_checkpoint("llama", **TARGET)


def eagle3(fc_bias=False) -> Eagle3Draft:
    torch.manual_seed(1)
    draft = Eagle3Draft.from_target_config(TARGET, draft_vocab_size=48, fc_bias=fc_bias)
    draft.set_vocab_map(*build_reduced_vocab(torch.randint(0, 50, (V,)), 48))
    return draft.eval()


def outputs(draft) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, V, (2, 8), generator=g)
    with torch.no_grad():
        if isinstance(draft, StandaloneDraft):
            return draft.forward_batch(ids)
        if isinstance(draft, MedusaDraft):
            return draft(torch.randn(2, 8, D, generator=g))
        if isinstance(draft, EagleDraft):
            return draft.forward_batch(ids, torch.randn(2, 8, D, generator=g))[1]
        return draft.to_target_logits(draft.forward_batch(ids, torch.randn(2, 8, 3 * D, generator=g))[1])


@pytest.mark.parametrize("fc_bias", [False, True])
def test_eagle3_sglang_layout_and_reload(fc_bias, tmp_path):
    """SGLang LlamaForCausalLMEagle3: architectures, draft_vocab_size, aux layer ids, midlayer.*/fc/norm/lm_head
    weight names, d2t offsets and t2d mask; reading it back gives identical logits."""
    draft = eagle3(fc_bias)
    save_draft(draft, tmp_path / "src", target_fingerprint="fp")
    out = export_draft(tmp_path / "src", "sglang", tmp_path / "sg", verifier="my/target")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["draft_vocab_size"] == 48 and cfg["vocab_size"] == V and cfg["num_hidden_layers"] == 1
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 3, 3]
    weights = load_file(str(out / "model.safetensors"))
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.hidden_norm.weight", "midlayer.self_attn.q_proj.weight"} <= set(weights)
    assert weights["midlayer.self_attn.q_proj.weight"].shape == (D, 2 * D)
    assert weights["fc.weight"].shape == (D, 3 * D) and ("fc.bias" in weights) == fc_bias
    assert weights["lm_head.weight"].shape == (48, D) and weights["t2d"].dtype == torch.bool
    assert torch.equal(torch.arange(48) + weights["d2t"], torch.nonzero(weights["t2d"])[:, 0])
    reloaded = load_exported(out)
    assert detect_format(cfg) == "sglang"
    assert torch.equal(outputs(reloaded), outputs(draft))


def test_eagle3_speculators_layout_and_reload(tmp_path):
    """vLLM speculators Eagle3Speculator: speculators_config (algorithm, proposal methods, verifier),
    transformer_layer_config, layers.0.* names; reading it back gives identical logits."""
    draft = eagle3()
    save_draft(draft, tmp_path / "src")
    out = export_draft(tmp_path / "src", "speculators", tmp_path / "sp", verifier="my/target", num_speculative_tokens=3)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["architectures"] == ["Eagle3Speculator"]
    spec = cfg["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["verifier"]["name_or_path"] == "my/target"
    assert spec["proposal_methods"][0]["speculative_tokens"] == 3 and spec["default_proposal_method"] == "greedy"
    assert cfg["transformer_layer_config"]["hidden_size"] == D and cfg["transformer_layer_config"]["vocab_size"] == V
    assert cfg["draft_vocab_size"] == 48 and cfg["target_hidden_size"] == D and cfg["norm_before_residual"] is False
    assert cfg["eagle_aux_hidden_state_layer_ids"] == draft.config.aux_layers
    weights = load_file(str(out / "model.safetensors"))
    assert "layers.0.hidden_norm.weight" in weights and not any(k.startswith("midlayer") for k in weights)
    assert torch.equal(outputs(load_exported(out)), outputs(draft))


# vLLM's EagleLlamaForCausalLM (vllm/model_executor/models/llama_eagle.py): the parameters its load_weights
# accepts for a one-layer draft (checkpoint names; it prefixes "model." itself and fuses q/k/v and gate/up).
VLLM_EAGLE_WEIGHTS = {"embed_tokens.weight", "fc.weight"} | {
    f"layers.0.{name}.weight" for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                           "self_attn.o_proj", "post_attention_layernorm", "mlp.gate_proj",
                                           "mlp.up_proj", "mlp.down_proj")
}


def eagle1(target_dir, fc_bias=False) -> EagleDraft:
    from draftsmith.kernels.layers.checkpoint import load_target_embed_and_head

    torch.manual_seed(2)
    draft = EagleDraft.from_target_config(TARGET, fc_bias=fc_bias).eval()
    draft.init_from_target(*load_target_embed_and_head(target_dir))
    return draft


def test_eagle1_vllm_layout_loads_with_the_verifier_head(tmp_path, target_dir):
    """vLLM `eagle` layout: a one-layer LlamaConfig (LlamaForCausalLM, which vLLM maps to EagleLlamaForCausalLM)
    and exactly the weights vLLM's EagleLlamaForCausalLM loads (fc without bias, layers.0.* without
    input_layernorm, embed_tokens; no lm_head: the verifier's is used). The verifier, a local dir, is stored
    absolute, and reading the export back finds its LM head there and gives identical logits."""
    draft = eagle1(target_dir)
    save_draft(draft, tmp_path / "src")
    out = export_draft(tmp_path / "src", "vllm", tmp_path / "vl", verifier=str(target_dir))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (1, D, V)
    assert LlamaConfig(**cfg).num_key_value_heads == TARGET["num_key_value_heads"]  # a valid HF LlamaConfig
    assert cfg["base_model_name_or_path"] == str(target_dir.resolve())
    weights = load_file(str(out / "model.safetensors"))
    assert set(weights) == VLLM_EAGLE_WEIGHTS
    assert weights["fc.weight"].shape == (D, 2 * D)
    assert detect_format(cfg, set(weights)) == "vllm"
    assert torch.equal(outputs(load_exported(out)), outputs(draft))


def test_eagle1_vllm_layout_refusals(tmp_path, target_dir):
    """An fc bias (vLLM's fc has none) and the speculators format (speculators has no EAGLE-1 type) are
    refused naming the way out; an export whose verifier is a hub id needs the target given at load."""
    save_draft(eagle1(target_dir, fc_bias=True), tmp_path / "bias")
    with pytest.raises(ValueError, match="without an fc bias"):
        export_draft(tmp_path / "bias", "vllm", tmp_path / "bad")
    save_draft(eagle1(target_dir), tmp_path / "src")
    with pytest.raises(ValueError, match="exports as format='vllm'"):
        export_draft(tmp_path / "src", "speculators", tmp_path / "bad")
    out = export_draft(tmp_path / "src", "vllm", tmp_path / "hub", verifier="my/target")
    with pytest.raises(ValueError, match="target_embed_and_head or target_dir"):
        load_exported(out)
    assert torch.equal(outputs(load_exported(out, target_dir=target_dir)), outputs(eagle1(target_dir)))


def test_relative_verifier_is_stored_absolute(tmp_path, target_dir, monkeypatch):
    """`--verifier ./target` (relative to where export runs) is written as an absolute path into every
    layout's verifier field, so an engine started elsewhere loads it rather than asking the hub for
    './target'; hub ids stay as given, and a path-like verifier that exists nowhere is refused before
    anything is written."""
    monkeypatch.chdir(target_dir.parent)
    relative = f"./{target_dir.name}"
    save_draft(eagle3(), tmp_path / "e3")
    save_draft(eagle1(target_dir), tmp_path / "e1")
    spec = json.loads((export_draft(tmp_path / "e3", "speculators", tmp_path / "sp", verifier=relative) / "config.json").read_text())
    sglang = json.loads((export_draft(tmp_path / "e3", "sglang", tmp_path / "sg", verifier=relative) / "config.json").read_text())
    vllm = json.loads((export_draft(tmp_path / "e1", "vllm", tmp_path / "vl", verifier=relative) / "config.json").read_text())
    absolute = str(target_dir.resolve())
    assert spec["speculators_config"]["verifier"]["name_or_path"] == absolute
    assert sglang["base_model_name_or_path"] == absolute and vllm["base_model_name_or_path"] == absolute
    hub = export_draft(tmp_path / "e3", "speculators", tmp_path / "hub", verifier="meta-llama/Llama-3.1-8B")
    assert json.loads((hub / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"] == "meta-llama/Llama-3.1-8B"
    with pytest.raises(ValueError, match="not an existing directory"):
        export_draft(tmp_path / "e3", "speculators", tmp_path / "missing", verifier="./no-such-target")
    assert not (tmp_path / "missing").exists()
    monkeypatch.chdir(tmp_path)  # loading from elsewhere still finds the verifier's LM head
    assert torch.equal(outputs(load_exported(tmp_path / "vl")), outputs(eagle1(target_dir)))


@pytest.mark.parametrize("shared", [True, False])
def test_medusa_layout_and_reload(shared, tmp_path):
    """Medusa-1 layout: medusa_num_heads/medusa_num_layers/base_model_name_or_path and medusa_head.{k}.{j}
    weights (a shared head written per head); reading it back gives identical logits."""
    torch.manual_seed(3)
    draft = MedusaDraft.from_target_config(TARGET, num_heads=3, num_layers=2, shared_lm_head=shared)
    for p in draft.parameters():
        torch.nn.init.normal_(p, std=0.1)
    save_draft(draft, tmp_path / "src")
    out = export_draft(tmp_path / "src", "medusa", tmp_path / "m", verifier="my/target")
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["medusa_num_heads"], cfg["medusa_num_layers"], cfg["base_model_name_or_path"]) == (3, 2, "my/target")
    weights = load_file(str(out / "medusa_lm_head.safetensors"))
    assert set(weights) == {f"medusa_head.{k}.{j}.linear.{w}" for k in range(3) for j in range(2) for w in ("weight", "bias")} | {
        f"medusa_head.{k}.2.weight" for k in range(3)
    }
    assert torch.equal(outputs(load_exported(out)), outputs(draft))


def test_standalone_hf_export_and_cli(tmp_path):
    """`python -m draftsmith.drafts.export src=... format=hf out=...` (Hydra-style args) writes a plain HF dir that
    reloads identically; a format that does not take the draft's kind is refused naming both."""
    torch.manual_seed(4)
    draft = StandaloneDraft.from_target_config(TARGET, num_layers=1).eval()
    save_draft(draft, tmp_path / "src")
    assert main([f"src={tmp_path / 'src'}", "format=hf", f"out={tmp_path / 'hf'}"]) == 0
    assert torch.equal(outputs(load_exported(tmp_path / "hf")), outputs(draft))
    with pytest.raises(ValueError, match="format='sglang' takes \\['eagle3'\\].*'standalone'"):
        export_draft(tmp_path / "src", "sglang", tmp_path / "bad")
    assert main(["--src", str(tmp_path / "src"), "--format", "medusa", "--out", str(tmp_path / "bad")]) == 2


@pytest.mark.parametrize("fmt", ["speculators", "sglang"])
def test_eagle3_on_the_final_hidden_is_refused_by_every_engine_layout(fmt, tmp_path, target_dir):
    """Layer L (the final norm's output) serves in our engine only: both EAGLE-3 layouts stop before writing,
    naming the layers an engine captures (the check sits once in export_draft, for every aux-reading kind)."""
    torch.manual_seed(1)
    draft = Eagle3Draft.from_target_config(TARGET, aux_layers=[1, 3, 6], draft_vocab_size=48)
    draft.set_vocab_map(*build_reduced_vocab(torch.randint(0, 50, (V,)), 48))
    save_draft(draft, tmp_path / "src")
    with pytest.raises(ValueError, match=r"aux layer ids \[6\]: .* decoder layers 0..5"):
        export_draft(tmp_path / "src", fmt, tmp_path / "out", verifier=str(target_dir))
    assert not (tmp_path / "out").exists()
