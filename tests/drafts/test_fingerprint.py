"""draftsmith.drafts.identity.target_fingerprint: the key the registry files drafts under.

Stable across save -> load -> save and resharding (it names the model, not the file); changed by any
single weight element or any computation-relevant config value.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

from draftsmith.drafts.identity import target_fingerprint


@pytest.fixture(scope="module")
def saved(family_checkpoint) -> Path:
    return family_checkpoint("llama", hidden_size=32, intermediate_size=64, max_position_embeddings=64)


@pytest.fixture(scope="module")
def tensors(saved) -> dict[str, torch.Tensor]:
    return load_file(str(saved / "model.safetensors"))


def copy_with(src: Path, dst: Path, tensors: dict[str, torch.Tensor] | None = None, config: dict | None = None) -> Path:
    """A copy of a checkpoint dir, optionally with other weights or config."""
    dst.mkdir(parents=True)
    raw_config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config if config is not None else raw_config))
    if tensors is None:
        shutil.copy(src / "model.safetensors", dst / "model.safetensors")
    else:
        save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_stable_across_save_load_and_resharding(saved, tmp_path):
    """Loading the checkpoint and saving it again, even in several shards, gives the same fingerprint."""
    fp = target_fingerprint(saved)
    assert fp == target_fingerprint(saved) and len(fp) == 16
    reloaded = LlamaForCausalLM.from_pretrained(saved, dtype=torch.float32)
    reloaded.save_pretrained(tmp_path / "resaved")
    assert target_fingerprint(tmp_path / "resaved") == fp
    reloaded.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    assert target_fingerprint(tmp_path / "sharded") == fp


def test_volatile_config_keys_do_not_count_but_real_ones_do(saved, tmp_path):
    """Who wrote the file (transformers_version) is ignored; a value that changes the computation is not."""
    config = json.loads((saved / "config.json").read_text())
    fp = target_fingerprint(saved)
    assert target_fingerprint(copy_with(saved, tmp_path / "a", config={**config, "transformers_version": "9.9"})) == fp
    assert target_fingerprint(copy_with(saved, tmp_path / "b", config={**config, "rope_theta": 12345.0})) != fp


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_single_weight_change_changes_it(saved, tensors, tmp_path_factory, data):
    """Property: perturbing one element of any one tensor (by the smallest step its dtype can) changes the fingerprint."""
    name = data.draw(st.sampled_from(sorted(tensors)))
    index = data.draw(st.integers(0, tensors[name].numel() - 1))
    changed = {k: v.clone() for k, v in tensors.items()}
    flat = changed[name].view(-1)
    flat[index] = torch.nextafter(flat[index], flat[index] + 1)
    out = copy_with(saved, tmp_path_factory.mktemp("changed") / "t", tensors=changed)
    assert target_fingerprint(out) != target_fingerprint(saved)


def test_renamed_tensor_and_bad_dirs(saved, tensors, tmp_path):
    """Same bytes under another tensor name is another model; a dir without weights or config is a ValueError."""
    renamed = {("x." + k if k == "lm_head.weight" else k): v for k, v in tensors.items()}
    assert target_fingerprint(copy_with(saved, tmp_path / "r", tensors=renamed)) != target_fingerprint(saved)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no \\*.safetensors weights"):
        target_fingerprint(tmp_path / "empty")
    with pytest.raises(ValueError, match="not a directory"):
        target_fingerprint(tmp_path / "nowhere")
