"""Bad input stops early with one clear line naming the file and field."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import BertConfig

from draftsmith.train.config import compose
from draftsmith.train.corpus import load_records
from draftsmith.train.pipeline.run import run
from draftsmith.train.target import validate_target_dir
from tiny_models import save_tiny_model
from draftsmith.train.tokenizer import train_tokenizer

REPO = Path(__file__).resolve().parents[2]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def tiny_llama_dir(path: Path, vocab_size: int, tokenizer_vocab: int) -> Path:
    tokenizer = train_tokenizer(["hello world, def f(x): return x"] * 4, vocab_size=tokenizer_vocab)
    return save_tiny_model(path, "llama", tokenizer=tokenizer, vocab_size=vocab_size, hidden_size=32,
                           intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                           architectures=["LlamaForCausalLM"])


def test_missing_target_path():
    """A target.path that does not exist is named in the error."""
    with pytest.raises(ValueError, match="target.path: /no/such/ckpt does not exist"):
        validate_target_dir("/no/such/ckpt")


def test_missing_target_path_via_cli_is_one_line(tmp_path):
    """Through the CLI the same error is one line on stderr (no traceback) and no stage starts."""
    proc = subprocess.run([sys.executable, "-m", "draftsmith.train.cli", "pipeline", "target.path=/no/such/ckpt",
                           f"artifacts_root={tmp_path}", "wandb.mode=disabled"], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env={**os.environ})
    assert proc.returncode != 0
    assert "draftsmith: error: target.path: /no/such/ckpt does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr and "stage=corpus" not in proc.stderr


def test_checkpoint_that_is_not_a_causal_lm(tmp_path):
    """A config whose architectures are not *ForCausalLM is refused, naming config.json and the field."""
    BertConfig(architectures=["BertModel"]).save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match=r"config.json: field 'architectures' is \['BertModel'\]"):
        validate_target_dir(tmp_path)


def test_missing_config_json(tmp_path):
    """A directory without config.json is refused, naming the file."""
    with pytest.raises(ValueError, match="config.json: missing"):
        validate_target_dir(tmp_path)


def test_tokenizer_larger_than_model_vocab(tmp_path):
    """A tokenizer with more tokens than the model's vocab_size is refused, naming both files/fields."""
    tiny_llama_dir(tmp_path, vocab_size=280, tokenizer_vocab=300)
    with pytest.raises(ValueError, match=r"tokenizer has \d+ tokens but .*config.json field 'vocab_size' is 280"):
        validate_target_dir(tmp_path)


def test_valid_checkpoint_passes(tmp_path):
    """A consistent small Llama checkpoint passes validation."""
    tiny_llama_dir(tmp_path, vocab_size=300, tokenizer_vocab=300)
    config, tokenizer = validate_target_dir(tmp_path)
    assert config.vocab_size == 300 and 256 < len(tokenizer) <= 300


def test_empty_dataset_file(tmp_path):
    """A zero-byte data file is refused, naming the file."""
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    with pytest.raises(ValueError, match="empty.jsonl: empty dataset file"):
        load_records(str(path))


def test_missing_field(tmp_path):
    """Records without a 'reference' field are refused, naming the file and the field."""
    path = write_jsonl(tmp_path / "nofield.jsonl", [{"domain": "x", "prompt": "p"}])
    with pytest.raises(ValueError, match="nofield.jsonl: missing field 'reference'"):
        load_records(str(path))


def test_malformed_json(tmp_path):
    """A file that is not JSON lines is refused in one line naming the file."""
    path = tmp_path / "broken.jsonl"
    path.write_text('{"domain": "x", "prompt": \n not json at all\n')
    with pytest.raises(ValueError, match="broken.jsonl: could not be read as a dataset"):
        load_records(str(path))


def test_empty_prompts_are_an_error_or_skipped_and_counted(tmp_path, caplog):
    """An empty prompt names the file, line and field; with on_bad_record=skip such rows are skipped
    and the log says how many (the field-by-field cases are in test_data_records.py)."""
    rows = [{"domain": "x", "prompt": p, "reference": "r"} for p in ["a", "", "  ", "b"]]
    path = write_jsonl(tmp_path / "some_empty.jsonl", rows)
    with pytest.raises(ValueError, match="some_empty.jsonl: empty field 'prompt' on line 2"):
        load_records(str(path))
    with caplog.at_level(logging.WARNING, logger="draftsmith"):
        records = load_records(str(path), on_bad_record="skip")
    assert [r["prompt"] for r in records] == ["a", "b"]
    assert "skipped_bad_records=2" in caplog.text


def test_all_prompts_empty(tmp_path):
    """A file whose prompts are all empty is refused even when skipping, naming the field."""
    path = write_jsonl(tmp_path / "all_empty.jsonl", [{"domain": "x", "prompt": "", "reference": "r"}])
    with pytest.raises(ValueError, match="all_empty.jsonl: no usable records \\(1 skipped: empty prompt x1"):
        load_records(str(path), on_bad_record="skip")


def test_pipeline_fails_on_bad_data_before_training(tmp_path):
    """The pipeline stops in its first stage on a bad data file: no tokenizer or target is built."""
    path = write_jsonl(tmp_path / "bad.jsonl", [{"domain": "x", "prompt": "p"}])
    cfg = compose(["pipeline=smoke", f"data.path={path}", f"artifacts_root={tmp_path / 'art'}", "wandb.mode=disabled"])
    with pytest.raises(ValueError, match="missing field 'reference'"):
        run(cfg)
    assert not (tmp_path / "art" / "tokenizers").exists() and not (tmp_path / "art" / "target-cache").exists()


def test_unknown_stage_is_refused_before_running(tmp_path):
    """An unknown pipeline stage name is refused before any stage runs."""
    cfg = compose(["pipeline=smoke", "pipeline.stages=[corpus,nope]", f"artifacts_root={tmp_path}", "wandb.mode=disabled"])
    with pytest.raises(ValueError, match="pipeline.stages: unknown stage 'nope'"):
        run(cfg)
    assert not (tmp_path / "corpus").exists()


def test_bad_wandb_mode(tmp_path):
    """An invalid wandb.mode is refused, naming the field."""
    cfg = compose(["pipeline=smoke", "pipeline.stages=[corpus]", f"artifacts_root={tmp_path}", "wandb.mode=sometimes"])
    with pytest.raises(ValueError, match="wandb.mode"):
        run(cfg)


def test_fingerprint_of_non_checkpoint(tmp_path):
    """Fingerprinting a dir without safetensors weights is refused, naming the dir."""
    from draftsmith.drafts.identity import target_fingerprint

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        target_fingerprint(tmp_path)
