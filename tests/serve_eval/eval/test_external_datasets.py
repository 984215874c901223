"""External benchmark domains: conf entries parse, local files load through `datasets`, and a dataset
that is not on this machine is skipped at once with a clear message (nothing is downloaded)."""
from __future__ import annotations

import json

import pytest

from draftsmith.serve_eval.eval.external_datasets import (DatasetUnavailable, ExternalDomain, domains_from_config,
                                               load_config_file, load_domains, load_prompts)


def spec_bench_file(tmp_path):
    """A miniature question.jsonl in Spec-Bench's format (category + turns)."""
    rows = [{"question_id": i, "category": c, "turns": [f"{c} question {i}", "follow-up"]}
            for i, c in enumerate(["writing", "roleplay", "translation", "translation", "summarization", "qa",
                                   "math_reasoning", "rag", "rag"])]
    path = tmp_path / "question.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_conf_entries_parse(monkeypatch, tmp_path):
    """conf/eval/{specbench,humaneval,gsm8k}.yaml give the six Spec-Bench domains, HumanEval and GSM8K;
    the Spec-Bench file path comes from SPEC_BENCH_QUESTIONS."""
    monkeypatch.setenv("SPEC_BENCH_QUESTIONS", str(tmp_path / "q.jsonl"))
    spec = load_config_file("specbench")
    assert [d.domain for d in spec] == ["conversation", "translation", "summarization", "qa", "math_reasoning", "rag"]
    assert all(d.data_files == str(tmp_path / "q.jsonl") and d.prompt_field == "turns.0" for d in spec)
    (humaneval,) = load_config_file("humaneval")
    assert (humaneval.path, humaneval.split, humaneval.prompt_field) == ("openai/openai_humaneval", "test", "prompt")
    (gsm8k,) = load_config_file("gsm8k")
    assert (gsm8k.path, gsm8k.name, gsm8k.prompt_field) == ("openai/gsm8k", "main", "question")


def test_spec_bench_file_loads_per_domain(monkeypatch, tmp_path):
    """Every Spec-Bench-style domain gets its own prompts (first turn, filtered by category, capped)."""
    monkeypatch.setenv("SPEC_BENCH_QUESTIONS", str(spec_bench_file(tmp_path)))
    loaded = load_domains(load_config_file("specbench"), cache_dir=tmp_path / "cache")
    assert loaded.skipped == []
    assert loaded.prompts["conversation"] == ["writing question 0", "roleplay question 1"]
    assert loaded.prompts["translation"] == ["translation question 2", "translation question 3"]
    assert loaded.prompts["rag"] == ["rag question 7", "rag question 8"]
    capped = ExternalDomain("rag", "json", split="train", data_files=str(tmp_path / "question.jsonl"),
                            prompt_field="turns.0", filter_field="category", filter_values=["rag"],
                            template="Q: {prompt}\nA:", max_prompts=1)
    assert load_prompts(capped, cache_dir=tmp_path / "cache") == ["Q: rag question 7\nA:"]


def test_hub_dataset_not_cached_is_skipped_offline(tmp_path):
    """GSM8K / HumanEval absent from the (empty) local cache: DatasetUnavailable saying how to provide it,
    the other domains still load, and the Hub offline switch is restored afterwards."""
    import datasets.config
    import huggingface_hub.constants as hub

    before = (datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE)
    (gsm8k,) = load_config_file("gsm8k")
    with pytest.raises(DatasetUnavailable, match="not in the local `datasets` cache"):
        load_prompts(gsm8k, cache_dir=tmp_path / "cache")
    assert (datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE) == before
    local = ExternalDomain("translation", "json", split="train", data_files=str(spec_bench_file(tmp_path)),
                           prompt_field="turns.0", filter_field="category", filter_values=["translation"])
    loaded = load_domains([gsm8k, *load_config_file("humaneval"), local], cache_dir=tmp_path / "cache")
    assert list(loaded.prompts) == ["translation"]
    assert [s["domain"] for s in loaded.skipped] == ["gsm8k", "humaneval"]
    assert "openai/gsm8k" in loaded.skipped[0]["reason"]


def test_missing_file_and_bad_fields_are_skipped_with_reasons(tmp_path):
    """A missing data file, a wrong prompt field and an empty filter each give a named, per-domain skip."""
    qfile = str(spec_bench_file(tmp_path))
    specs = [ExternalDomain("gone", "json", split="train", data_files=str(tmp_path / "nope.jsonl")),
             ExternalDomain("badfield", "json", split="train", data_files=qfile, prompt_field="question"),
             ExternalDomain("empty", "json", split="train", data_files=qfile, prompt_field="turns.0",
                            filter_field="category", filter_values=["poetry"])]
    loaded = load_domains(specs, cache_dir=tmp_path / "cache")
    reasons = {s["domain"]: s["reason"] for s in loaded.skipped}
    assert loaded.prompts == {}
    assert "nope.jsonl not found" in reasons["gone"]
    assert "field 'question' not found" in reasons["badfield"]
    assert "no prompts" in reasons["empty"]


def test_bad_entries_are_refused():
    """Unknown keys, a template without {prompt} and a filter without values raise ValueError naming them."""
    with pytest.raises(ValueError, match="unknown field.*promt"):
        domains_from_config({"external_domains": [{"domain": "x", "path": "json", "promt": "p"}]})
    with pytest.raises(ValueError, match="template"):
        ExternalDomain("x", "json", template="no placeholder")
    with pytest.raises(ValueError, match="filter_values"):
        ExternalDomain("x", "json", filter_field="category")
    assert domains_from_config({}) == []
