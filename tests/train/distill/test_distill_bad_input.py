"""Bad input to the distill job fails before training with a ValueError naming the values involved:
tokenizer mismatch, a data cache of another target, a dataset without the needed fields, a hidden-state
cache over the disk cap, an init_from of another kind."""
import json
import os
import shutil

import pytest
import torch

from distill_fixtures import VOCAB, make_corpus, make_target, overrides

os.environ.setdefault("DRAFTSMITH_NO_PROGRESS", "1")
FAST = {"draft.data.max_new_tokens": "6", "draft.data.max_prompts": "16", "draft.data.shard_size": "16",
        "++train.max_steps": "1", "++train.batch_size": "4"}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad")
    torch.set_num_threads(1)
    return tmp, make_target(tmp / "target"), make_corpus(tmp / "corpus.jsonl", per_domain=8)


def job(world, fn="distill", **extra):
    from draftsmith.train.config import compose
    from draftsmith.train.distill.run import run
    from draftsmith.train.distill.dataset.job import run as generate

    tmp, target, corpus = world
    cfg = compose(overrides(tmp, target, corpus, **{**FAST, **extra}))
    return (run if fn == "distill" else generate)(cfg)


def test_tokenizer_mismatch_names_the_token(world, tmp_path):
    """A warm-start draft carrying another tokenizer is refused, naming a token and both ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from draftsmith.drafts.io import save_draft
    from draftsmith.drafts.standalone import StandaloneDraft

    draft_dir = tmp_path / "foreign"
    save_draft(StandaloneDraft.from_target_config(world[1]), draft_dir)
    swapped = {f"w{i}": (i + 1) % VOCAB for i in range(VOCAB)}  # same size, other ids
    tok = Tokenizer(models.WordLevel(swapped, unk_token="w1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w1").save_pretrained(draft_dir)
    with pytest.raises(ValueError, match=r"tokenizer differs from the target's.*token 'w\d+' -> id \d+ in draft.init_from, \d+ in the target"):
        job(world, draft="standalone", **{"draft.init_from": str(draft_dir)})


def test_cache_of_another_target_fingerprint(world):
    """A data cache whose manifest names another target fingerprint is refused, naming both."""
    cache = job(world, fn="generate", draft="standalone")
    foreign = cache.parent / "foreign-cache"
    shutil.copytree(cache, foreign, dirs_exist_ok=True)
    manifest = json.loads((foreign / "manifest.json").read_text())
    real = manifest["target_fingerprint"]
    manifest["target_fingerprint"] = "0123456789abcdef"
    (foreign / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=f"target fingerprint 0123456789abcdef, but the target's fingerprint is {real}"):
        job(world, draft="standalone", **{"draft.data.path": str(foreign)})


def test_dataset_missing_fields(world):
    """A cache whose dataset lacks prompt_length is refused, naming the missing field."""
    import datasets

    cache = job(world, fn="generate", draft="standalone")
    broken = cache.parent / "broken-cache"
    shutil.copytree(cache, broken, dirs_exist_ok=True)
    rows = datasets.load_from_disk(str(cache / "dataset")).remove_columns(["prompt_length"])
    shutil.rmtree(broken / "dataset")
    rows.save_to_disk(str(broken / "dataset"))
    with pytest.raises(ValueError, match=r"dataset is missing fields \['prompt_length'\]"):
        job(world, draft="standalone", **{"draft.data.path": str(broken)})


def test_offline_mode_needs_cached_hidden_states(world):
    """Offline EAGLE on a cache without hidden states is refused, naming what it holds and needs."""
    cache = job(world, fn="generate", draft="standalone")
    with pytest.raises(ValueError, match="field 'extras' holds .*final_hidden': False.* but this job needs .*final_hidden': True"):
        job(world, draft="eagle", **{"draft.mode": "offline", "draft.data.path": str(cache), "draft.data.store_hidden": "false"})


def test_hidden_cache_over_disk_cap_refused_before_start(world):
    """The size estimate over draft.data.disk_cap_gb stops the job before any shard is written."""
    with pytest.raises(ValueError, match=r"draft.data.disk_cap_gb: .* up to \d+\.\d+ GB .* over the cap of 1e-06 GB"):
        job(world, draft="eagle3", **{"draft.mode": "offline", "draft.data.disk_cap_gb": "1e-6"})
    data_root = next((world[0] / "artifacts" / "targets").iterdir()) / "data"
    assert not list(data_root.glob("*/shard-*"))  or all(
        json.loads((d / "manifest.json").read_text())["extras"]["aux_layers"] == [] for d in data_root.iterdir() if (d / "manifest.json").exists())


def test_init_from_other_kind(world, tmp_path):
    """init_from pointing at a draft of another kind names both kinds."""
    from draftsmith.drafts.io import save_draft
    from draftsmith.drafts.medusa import MedusaDraft

    medusa_dir = save_draft(MedusaDraft.from_target_config(world[1]), tmp_path / "medusa")
    with pytest.raises(ValueError, match="holds a 'medusa' draft, this job trains 'eagle'"):
        job(world, draft="eagle", **{"draft.init_from": str(medusa_dir)})


def test_init_target_layers_that_the_target_lacks(world):
    """A standalone warm start from a layer the target does not have stops, naming the field and the count
    (not skipped as a width mismatch would be)."""
    with pytest.raises(ValueError, match=r"draft.init_target_layers: layer ids \[7\] must name 1 of the target's"):
        job(world, draft="standalone", **{"draft.num_layers": "1", "draft.init_target_layers": "[7]"})
