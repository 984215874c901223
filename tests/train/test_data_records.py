"""A dataset record missing a field, or with an empty one, is an error naming the file, the line and
the field; with data.on_bad_record=skip it is skipped and the log says how many and why."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from draftsmith.serve_eval.eval.sources import load_prompt_records
from draftsmith.drafts.artifacts import Artifacts
from draftsmith.train.config import DataConfig, compose
from draftsmith.train.corpus import build_corpus, load_records


def _jsonl(path: Path, rows: list[dict | None]) -> Path:
    """None writes a blank line (which must not shift the reported line numbers)."""
    path.write_text("".join("\n" if r is None else json.dumps(r) + "\n" for r in rows))
    return path


def _good(i: int, domain: str = "qa") -> dict:
    return {"domain": domain, "prompt": f"q{i}?", "reference": f"a{i}"}


@pytest.mark.parametrize(
    ("bad", "expected"),
    [
        ({"domain": "qa", "reference": "a"}, "missing field 'prompt' on line 4"),
        ({"domain": "qa", "prompt": "q", "reference": "  "}, "empty field 'reference' on line 4"),
        ({"domain": None, "prompt": "q", "reference": "a"}, "missing field 'domain' on line 4"),
        ({"domain": "qa", "prompt": 7, "reference": "a"}, r"non-string \(int\) field 'prompt' on line 4"),
    ],
)
def test_bad_record_is_an_error_naming_file_line_and_field(tmp_path, bad, expected):
    path = _jsonl(tmp_path / "prompts.jsonl", [_good(0), None, _good(1), bad, _good(2)])
    with pytest.raises(ValueError, match=f"prompts.jsonl: {expected} .*on_bad_record=skip"):
        load_records(str(path))


def test_skip_mode_skips_and_counts_with_reasons(tmp_path, caplog):
    rows = [_good(0), {"domain": "qa", "reference": "a"}, _good(1), {"domain": "qa", "prompt": "", "reference": "a"},
            {"domain": "qa", "reference": "b"}, _good(2)]
    path = _jsonl(tmp_path / "prompts.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="draftsmith"):
        records = load_records(str(path), on_bad_record="skip")
    assert [r["prompt"] for r in records] == ["q0?", "q1?", "q2?"]
    assert "skipped_bad_records=3" in caplog.text
    assert "empty prompt x1, missing prompt x2 (first: line 2)" in caplog.text
    assert str(path) in caplog.text


def test_other_sources_name_the_record(tmp_path):
    """A json array (read through `datasets`) names the 1-based record; csv names the file line."""
    array = tmp_path / "prompts.json"
    array.write_text(json.dumps([_good(0), {"domain": "qa", "prompt": "", "reference": "a"}]))
    with pytest.raises(ValueError, match="prompts.json: empty field 'prompt' on record 2"):
        load_records(str(array))
    csv = tmp_path / "prompts.csv"
    csv.write_text("domain,prompt,reference\nqa,q0,a0\nqa,q1,\n")
    with pytest.raises(ValueError, match="prompts.csv: missing field 'reference' on line 3"):
        load_records(str(csv))


def test_policy_is_a_data_config_field(tmp_path):
    """data.on_bad_record defaults to error in the schema and conf/data/file.yaml; an unknown value is refused."""
    assert DataConfig().on_bad_record == "error"
    path = _jsonl(tmp_path / "p.jsonl", [_good(0)])
    cfg = compose(["data=file", f"data.path={path}", "data.on_bad_record=skip", f"artifacts_root={tmp_path}"])
    assert cfg.data.on_bad_record == "skip"
    with pytest.raises(ValueError, match="data.on_bad_record: 'ignore' is not one of"):
        load_records(str(path), on_bad_record="ignore")


def _corpus_cfg(path: Path, **data: str):
    base = DataConfig(path=str(path), domains=["qa"], eval_per_domain=2, distill_per_domain=10)
    return OmegaConf.create({"data": OmegaConf.merge(OmegaConf.structured(base), data), "seed": 0})


def test_corpus_stage_names_the_bad_record_instead_of_an_empty_split(tmp_path, caplog):
    """The reported failure: a record without `prompt` used to vanish and the job died later with
    "the distill split is empty". Now the corpus stage names file, line and field; skip mode builds
    the corpus from the good records and logs the skip."""
    path = _jsonl(tmp_path / "prompts.jsonl", [_good(i) for i in range(6)] + [{"domain": "qa", "reference": "x"}])
    with pytest.raises(ValueError, match="prompts.jsonl: missing field 'prompt' on line 7"):
        build_corpus(_corpus_cfg(path), Artifacts(tmp_path / "art"))
    with caplog.at_level(logging.WARNING, logger="draftsmith"):
        corpus, _ = build_corpus(_corpus_cfg(path, on_bad_record="skip"), Artifacts(tmp_path / "art"))
    assert len(corpus.records("eval")) == 2 and len(corpus.records("distill")) == 4
    assert "skipped_bad_records=1" in caplog.text


@pytest.mark.parametrize(
    ("bad", "expected"),
    [({"domain": "code"}, "missing field 'prompt' on line 3"), ({"domain": "code", "prompt": " "}, "empty field 'prompt' on line 3")],
)
def test_eval_prompt_file_names_file_line_and_field(tmp_path, bad, expected):
    path = _jsonl(tmp_path / "eval.jsonl", [{"domain": "code", "prompt": "def f("}, None, bad])
    with pytest.raises(ValueError, match=f"eval.jsonl: {expected}"):
        load_prompt_records(path)
