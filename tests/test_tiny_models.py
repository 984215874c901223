"""The shared tiny-model factory (tests/tiny_models.py, conftest's family_checkpoint): it names every model type
the executor supports, each family's saved checkpoint serves HF's logits through the executor, and the weights
HF initialises to constants are re-drawn (so the router, q/k-norm and bias paths are exercised)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from draftsmith.kernels.layers.family import SUPPORTED_MODEL_TYPES
from draftsmith.serve_eval.engine.model_executor import ModelExecutor
from test_executor import SHAPE, TOL, run_schedule_and_compare
from tiny_models import FAMILIES, YARN, tiny_config, tiny_model


def test_every_supported_model_type_has_a_family():
    assert {family.architecture for family in FAMILIES.values()} == set(SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_checkpoint_serves_hf_logits(family_checkpoint, family):
    """The saved dir loads in the executor and its mixed prefill / decode logits equal transformers'."""
    path = family_checkpoint(family, shape=SHAPE)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert model.config.model_type == FAMILIES[family].architecture
    assert run_schedule_and_compare(model, ModelExecutor(path)) < TOL


def test_constant_initialised_weights_are_redrawn():
    moe = dict(tiny_model("qwen3_moe").named_parameters())
    assert all(p.abs().sum() > 0 for name, p in moe.items() if name.endswith("mlp.gate.weight"))
    assert all(not torch.all(p == 1) for name, p in moe.items() if name.endswith(("q_norm.weight", "k_norm.weight")))
    biases = [p for name, p in tiny_model("qwen2").named_parameters() if name.endswith("bias")]
    assert biases and all(p.abs().sum() > 0 for p in biases)


def test_family_fields_and_overrides():
    """A family's defining fields survive, caller fields override the shape, and Qwen3 keeps hidden / heads as its
    head_dim (its own default is 128); an unknown family is refused by name."""
    yarn = tiny_config("llama-yarn", hidden_size=32, num_hidden_layers=4)
    assert yarn.rope_scaling["rope_type"] == YARN["rope_type"] and (yarn.hidden_size, yarn.num_hidden_layers) == (32, 4)
    assert tiny_config("qwen3", hidden_size=32).head_dim == 8
    assert tiny_config("mistral-window").sliding_window == FAMILIES["mistral-window"].fields["sliding_window"]
    with pytest.raises(ValueError, match="unknown family 'gpt2'"):
        tiny_config("gpt2")
