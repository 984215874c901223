"""Every `speculators` export carries the fields, with the types, that speculators' own config classes
declare for its model type, and only kinds speculators has a type for are exported that way.

The field lists below are data copied from the speculators sources (vllm-project/speculators, the 0.9
line whose registered model types are the ones in SPECULATORS_MODEL_TYPES), not imported: speculators is
not a dependency of draftsmith. Each list names the file and commit it was read from.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from draftsmith.drafts.eagle3 import Eagle3Draft, build_reduced_vocab
from draftsmith.drafts.export import FORMATS, export_draft
from draftsmith.drafts.io import save_draft

# speculators 0.9 refuses any other speculators_model_type ("model type `eagle` is not among ...").
SPECULATORS_MODEL_TYPES = {"dflash", "dflash2", "dspark", "eagle3", "mtp", "peagle", "xpress"}
# our draft kind -> the speculators_model_type its export declares
MODEL_TYPE_OF_KIND = {"eagle3": "eagle3", "block": "dflash"}

# field -> (accepted JSON types, required). `None` in the types: the field may be null.
# src/speculators/config.py @ 03a7c1497cdbb0cf6a3cdffc86aead090034c285, class SpeculatorModelConfig
# (pydantic extra="allow": further keys are kept, so ours are namespaced draftsmith_*).
SPECULATOR_MODEL_CONFIG = {
    "speculators_model_type": ((str,), True),
    "speculators_version": ((str,), False),
    "speculators_config": ((dict,), True),
}
# same file, class SpeculatorsConfig (every field required)
SPECULATORS_CONFIG = {
    "algorithm": ((str,), True),
    "proposal_methods": ((list,), True),
    "default_proposal_method": ((str,), True),
    "verifier": ((dict,), True),
}
# same file, class VerifierConfig (no defaults: both required)
VERIFIER_CONFIG = {
    "name_or_path": ((str, type(None)), True),
    "architectures": ((list,), True),
}
# src/speculators/proposals/greedy.py @ 3cddab65178265627483e710e17a7dd349153452, GreedyTokenProposalConfig
# (speculative_tokens >= 1, verifier_accept_k >= 1, accept_tolerance >= 0)
GREEDY_PROPOSAL = {
    "proposal_type": ((str,), True),
    "speculative_tokens": ((int,), False),
    "verifier_accept_k": ((int,), False),
    "accept_tolerance": ((float, int), False),
}
# src/speculators/models/eagle3/config.py @ 11ecdd3385ed00258b89b0de8b55a0074ced9ec4, Eagle3SpeculatorConfig
EAGLE3_SPECULATOR_CONFIG = {
    **SPECULATOR_MODEL_CONFIG,
    "architectures": ((list,), False),
    "transformer_layer_config": ((dict,), False),
    "draft_vocab_size": ((int,), False),
    "norm_before_residual": ((bool,), False),
    "enable_sp_ulysses": ((bool,), False),
    "target_hidden_size": ((int, type(None)), False),
    "eagle_aux_hidden_state_layer_ids": ((list, type(None)), False),
    "embed_requires_grad": ((bool,), False),
}
MODEL_CONFIG_OF_TYPE = {"eagle3": EAGLE3_SPECULATOR_CONFIG}

V, D = 128, 64
TARGET = dict(hidden_size=D, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, vocab_size=V)


def _check_fields(obj: dict, fields: dict, where: str, *, closed: bool) -> None:
    """Required fields present, each known field of an accepted JSON type (bool is not an int here, as
    pydantic's strict reading would have it); `closed`: no keys outside the class."""
    for name, (types, required) in fields.items():
        if name not in obj:
            assert not required, f"{where}: missing required field {name!r}"
            continue
        value = obj[name]
        assert isinstance(value, types) and not (isinstance(value, bool) and bool not in types), (
            f"{where}.{name}: {value!r} is not {types}")
    if closed:
        assert set(obj) <= set(fields), f"{where}: fields speculators does not declare: {sorted(set(obj) - set(fields))}"


def _check_speculators_export(config: dict) -> None:
    model_type = config["speculators_model_type"]
    assert model_type in SPECULATORS_MODEL_TYPES
    fields = MODEL_CONFIG_OF_TYPE[model_type]
    _check_fields(config, fields, "config", closed=False)
    assert all(key.startswith("draftsmith_") for key in set(config) - set(fields)), sorted(set(config) - set(fields))
    spec = config["speculators_config"]
    _check_fields(spec, SPECULATORS_CONFIG, "speculators_config", closed=True)
    assert spec["algorithm"] == model_type
    _check_fields(spec["verifier"], VERIFIER_CONFIG, "speculators_config.verifier", closed=True)
    for proposal in spec["proposal_methods"]:
        assert proposal["proposal_type"] == "greedy"  # the one proposal type we write
        _check_fields(proposal, GREEDY_PROPOSAL, "proposal_methods[]", closed=True)
        assert proposal["speculative_tokens"] >= 1 and proposal["verifier_accept_k"] >= 1 and proposal["accept_tolerance"] >= 0
    assert spec["default_proposal_method"] in {p["proposal_type"] for p in spec["proposal_methods"]}
    layer = LlamaConfig(**config["transformer_layer_config"])  # speculators builds a LlamaConfig from it
    assert layer.model_type == "llama" and layer.num_hidden_layers == 1


def test_only_kinds_speculators_has_a_type_for_export_as_speculators():
    """EAGLE-1 is not among speculators' model types, so the speculators format takes EAGLE-3 and the block
    draft (speculators' dflash) only."""
    assert set(FORMATS["speculators"]) == set(MODEL_TYPE_OF_KIND)
    assert set(MODEL_TYPE_OF_KIND.values()) <= SPECULATORS_MODEL_TYPES


@pytest.mark.parametrize("fc_bias,norm_before_residual,verifier", [
    (False, False, "meta-llama/Llama-3.1-8B-Instruct"),
    (True, True, None),
])
def test_speculators_export_matches_the_config_classes(tmp_path: Path, fc_bias, norm_before_residual, verifier):
    """An EAGLE-3 speculators export, with and without fc bias / norm_before_residual / a verifier, has
    every required field of Eagle3SpeculatorConfig, SpeculatorsConfig, VerifierConfig and the greedy
    proposal, each of its declared type, nested configs without undeclared keys, and values that agree
    with the draft (vocab sizes, aux layers)."""
    torch.manual_seed(1)
    draft = Eagle3Draft.from_target_config(TARGET, draft_vocab_size=48, fc_bias=fc_bias, norm_before_residual=norm_before_residual)
    draft.set_vocab_map(*build_reduced_vocab(torch.randint(0, 50, (V,)), 48))
    save_draft(draft, tmp_path / "src")
    out = export_draft(tmp_path / "src", "speculators", tmp_path / "sp", verifier=verifier, num_speculative_tokens=4)
    config = json.loads((out / "config.json").read_text())
    _check_speculators_export(config)
    assert config["draft_vocab_size"] == 48 and config["transformer_layer_config"]["vocab_size"] == V
    assert config["eagle_aux_hidden_state_layer_ids"] == list(draft.config.aux_layers)
    assert config["norm_before_residual"] is norm_before_residual
    assert config["speculators_config"]["verifier"]["name_or_path"] == verifier
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4


# ---------------------------------------------------------------------------------------------- explicit values

# What vLLM builds the draft layer from (speculators' transformer_layer_config; SGLang reads the same fields at
# the top level): written out, never left to the reader's defaults.
LLAMA_LAYER_FIELDS = ("model_type", "num_hidden_layers", "vocab_size", "hidden_size", "num_attention_heads",
                      "num_key_value_heads", "head_dim", "intermediate_size", "rms_norm_eps", "rope_theta", "rope_scaling",
                      "attention_bias", "mlp_bias", "hidden_act", "max_position_embeddings", "tie_word_embeddings",
                      "torch_dtype")
# draftsmith/drafts/export_block.py's docstring: the fields speculators documents for DFlash
DFLASH_FIELDS = ("architectures", "speculators_model_type", "speculators_version", "block_size",
                 "aux_hidden_state_layer_ids", "target_hidden_size", "draft_vocab_size", "num_hidden_layers",
                 "mask_token_id", "transformer_layer_config", "speculators_config")
# SpecForge's EAGLE-3 draft configs for Qwen3 targets (configs/qwen3-8b-eagle3.json, qwen3-30B-A3B-eagle3.json):
# a one-layer LlamaForCausalLMEagle3 with these keys, head_dim the target's (not hidden_size / heads)
SGLANG_EAGLE3_FIELDS = ("architectures", "model_type", "attention_bias", "head_dim", "hidden_act", "hidden_size",
                        "intermediate_size", "max_position_embeddings", "num_attention_heads", "num_hidden_layers",
                        "num_key_value_heads", "rms_norm_eps", "rope_scaling", "rope_theta", "tie_word_embeddings",
                        "torch_dtype", "vocab_size", "draft_vocab_size")
QWEN3 = dict(TARGET, model_type="qwen3", head_dim=32, rope_theta=1_000_000.0, max_position_embeddings=40960,
             architectures=["Qwen3ForCausalLM"])
QWEN3_MOE = dict(QWEN3, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                 architectures=["Qwen3MoeForCausalLM"])


def _eagle3_dir(tmp_path: Path, target: dict, draft_vocab: int = 48) -> Path:
    torch.manual_seed(2)
    draft = Eagle3Draft.from_target_config(target, draft_vocab_size=draft_vocab)
    draft.set_vocab_map(*build_reduced_vocab(torch.randint(0, 50, (V,)), draft_vocab))
    save_draft(draft, tmp_path / "src")
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps(target))  # the verifier dir the export reads
    return tmp_path / "src"


def _explicit(obj: dict, names, where: str) -> None:
    missing = [n for n in names if n not in obj]
    assert not missing, f"{where}: fields left to the reader's defaults: {missing}"


@pytest.mark.parametrize("target", [TARGET | {"architectures": ["LlamaForCausalLM"]}, QWEN3, QWEN3_MOE],
                         ids=["llama", "qwen3", "qwen3_moe"])
def test_eagle3_speculators_fields_are_explicit(tmp_path: Path, target):
    """Every field Eagle3SpeculatorConfig declares is written (none defaulted), the layer config carries every
    LlamaConfig field the draft layer needs with the target's values (Qwen3's head_dim and rope_theta), the
    verifier's architecture is the target's, and d2t / t2d are in the weights: d2t int64 offsets over the
    draft vocabulary, t2d a bool mask over the target's, naming the same ids."""
    from safetensors.torch import load_file

    out = export_draft(_eagle3_dir(tmp_path, target), "speculators", tmp_path / "sp", verifier=str(tmp_path / "target"))
    config = json.loads((out / "config.json").read_text())
    _check_speculators_export(config)
    _explicit(config, EAGLE3_SPECULATOR_CONFIG, "config")
    layer = config["transformer_layer_config"]
    _explicit(layer, LLAMA_LAYER_FIELDS, "transformer_layer_config")
    assert layer["head_dim"] == target.get("head_dim", D // 4) and layer["rope_theta"] == target.get("rope_theta", 10000.0)
    assert LlamaConfig(**layer).head_dim == layer["head_dim"]
    assert config["speculators_config"]["verifier"]["architectures"] == target["architectures"]
    assert config["embed_requires_grad"] is False and config["norm_before_residual"] is False
    weights = load_file(str(out / "model.safetensors"))
    d2t, t2d = weights["d2t"], weights["t2d"]
    assert d2t.dtype == torch.int64 and tuple(d2t.shape) == (config["draft_vocab_size"],)
    assert t2d.dtype == torch.bool and tuple(t2d.shape) == (layer["vocab_size"],)
    assert torch.equal(torch.nonzero(t2d).flatten(), torch.arange(d2t.numel()) + d2t)


@pytest.mark.parametrize("target", [QWEN3, QWEN3_MOE], ids=["qwen3", "qwen3_moe"])
def test_sglang_eagle3_layout_for_qwen3_targets(tmp_path: Path, target):
    """A draft for a Qwen3 (dense or MoE) target exports in SpecForge's Qwen3 layout: LlamaForCausalLMEagle3,
    model_type llama, every SpecForge key present, head_dim the target's, aux layers named, and it reads back
    into the same module (bit-equal weights)."""
    from draftsmith.drafts.export import load_exported
    from draftsmith.drafts.io import load_draft

    src = _eagle3_dir(tmp_path, target)
    out = export_draft(src, "sglang", tmp_path / "sg", verifier=str(tmp_path / "target"))
    config = json.loads((out / "config.json").read_text())
    _explicit(config, SGLANG_EAGLE3_FIELDS, "sglang config")
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["head_dim"] == 32 != config["hidden_size"] // config["num_attention_heads"]
    assert config["rope_theta"] == 1_000_000.0 and config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 3, 3]
    assert LlamaConfig(**config).head_dim == 32
    ours, theirs = load_draft(src).model.state_dict(), load_exported(out).state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_verifier_architecture_given_or_read(tmp_path: Path):
    """A hub-id verifier takes the architecture it is given; a local dir's config.json names its own."""
    src = _eagle3_dir(tmp_path, QWEN3)
    hub = export_draft(src, "speculators", tmp_path / "hub", verifier="Qwen/Qwen3-8B",
                       verifier_architecture="Qwen3ForCausalLM")
    verifier = json.loads((hub / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": "Qwen/Qwen3-8B", "architectures": ["Qwen3ForCausalLM"]}
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="names no architectures"):
        export_draft(src, "speculators", tmp_path / "bad", verifier=str(tmp_path / "bare"))


def test_dflash_fields_are_explicit(tmp_path: Path):
    """The block draft's speculators (DFlash) export writes each documented field and a full layer config."""
    from draftsmith.drafts.block import BlockDraft

    torch.manual_seed(3)
    save_draft(BlockDraft.from_target_config(QWEN3, block_size=4), tmp_path / "block")
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps(QWEN3))
    out = export_draft(tmp_path / "block", "speculators", tmp_path / "df", verifier=str(tmp_path / "target"),
                       num_speculative_tokens=3)
    config = json.loads((out / "config.json").read_text())
    _explicit(config, DFLASH_FIELDS, "dflash config")
    _explicit(config["transformer_layer_config"], [f for f in LLAMA_LAYER_FIELDS if f != "torch_dtype"],
              "dflash transformer_layer_config")
    assert config["speculators_config"]["verifier"]["architectures"] == ["Qwen3ForCausalLM"]
    assert config["transformer_layer_config"]["head_dim"] == 32
