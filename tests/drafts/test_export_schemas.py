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

from drafts.eagle3 import Eagle3Draft, build_reduced_vocab
from drafts.export import FORMATS, export_draft
from drafts.io import save_draft

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
