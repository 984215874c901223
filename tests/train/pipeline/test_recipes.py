"""Recipe settings: bad input stops early with one line; mixed data, covering caches, coverage-sized vocab, caps."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from draftsmith.drafts.schemas import BlockSchema, DraftDataConfig, Eagle3Schema, MedusaSchema, StandaloneSchema
from draftsmith.train.config import compose
from draftsmith.train.distill.gendata import Manifest, StoredExtras, find_covering
from draftsmith.drafts.schemas import answer_temperature
from draftsmith.train.distill.dataset.settings import cache_key, content_key
from draftsmith.train.pipeline.run import check_stage_configs
from draftsmith.train.recipes import check_recipe, recipe_warnings, reduced_vocab_size

REPO = Path(__file__).resolve().parents[3]


def node(schema, **fields):
    cfg = OmegaConf.structured(schema)
    for key, value in fields.items():
        OmegaConf.update(cfg, key, value)
    return cfg


@pytest.mark.parametrize("kind, schema, fields, message", [
    ("standalone", StandaloneSchema, {"loss": "token_kd", "teacher": "topk", "data.topk_logits": 0},
     "draft.data.topk_logits: 0"),
    ("standalone", StandaloneSchema, {"data.sampled_fraction": 1.5}, "draft.data.sampled_fraction: 1.5 is outside [0, 1]"),
    ("eagle3", Eagle3Schema, {"data.sampled_fraction": -0.1}, "draft.data.sampled_fraction: -0.1 is outside [0, 1]"),
    ("eagle3", Eagle3Schema, {"draft_vocab_size": 5000}, "draft.draft_vocab_size: 5000 is outside 1..4096"),
    ("eagle3", Eagle3Schema, {"draft_vocab_coverage": 1.5}, "draft.draft_vocab_coverage: 1.5"),
    ("eagle3", Eagle3Schema, {"label_temperature": 0.0}, "draft.label_temperature: 0.0 must be > 0"),
    ("block", BlockSchema, {"label_temperature": -1.0}, "draft.label_temperature: -1.0 must be > 0"),
    ("eagle3", Eagle3Schema, {"ttt_steps": 0}, "draft.ttt_steps: 0 must be >= 1"),
    ("block", BlockSchema, {"max_anchors": 0}, "draft.max_anchors: 0 must be >= 1"),
    ("medusa", MedusaSchema, {"train_temperatures": [0.0, 0.7], "data.sampled_fraction": 0.5},
     "draft.train_temperatures: [0.0, 0.7] names [0.7], but the dataset's answers are generated at [0.0, 1.0]"),
    ("medusa", MedusaSchema, {"train_temperatures": [1.0]}, "names [1.0], but the dataset's answers are generated at [0.0]"),
    ("medusa", MedusaSchema, {"train_temperatures": [0.0], "data.sampled_fraction": 1.0},
     "names [0.0], but the dataset's answers are generated at [1.0]"),   # every answer sampled
    ("block", BlockSchema, {"train_temperatures": [0.0], "data.source": "corpus"}, "none (data.source=corpus)"),
    ("block", BlockSchema, {"train_temperatures": []}, "names no temperature"),
])
def test_recipe_that_cannot_work_is_one_line_naming_field_and_value(kind, schema, fields, message):
    with pytest.raises(ValueError) as err:
        check_recipe(kind, node(schema, **fields), 4096)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_working_recipes_pass_and_a_short_unroll_warns():
    check_recipe("standalone", node(StandaloneSchema, loss="token_kd", teacher="topk", **{"data.topk_logits": 16}), 4096)
    check_recipe("eagle3", node(Eagle3Schema, draft_vocab_size=1024, ttt_steps=4), 4096)
    assert recipe_warnings("eagle3", node(Eagle3Schema, ttt_steps=4), [2, 4]) == []
    [line] = recipe_warnings("eagle3", node(Eagle3Schema, ttt_steps=2), [2, 4])
    assert "ttt_steps=2" in line and "K=4" in line


def test_training_on_some_temperatures_passes_and_warns_where_the_eval_samples_elsewhere():
    greedy_half = node(MedusaSchema, train_temperatures=[0.0], **{"data.sampled_fraction": 0.5})
    check_recipe("medusa", greedy_half, 4096)
    assert recipe_warnings("medusa", greedy_half, [4], [0.0]) == []
    assert recipe_warnings("medusa", node(MedusaSchema, **{"data.sampled_fraction": 0.5}), [4], [0.0, 1.0]) == []
    [line] = recipe_warnings("medusa", greedy_half, [4], [0.0, 1.0])
    assert "draft.train_temperatures=[0.0]" in line and "T=[1.0]" in line and "eval.temperatures_of.medusa" in line


def test_pipeline_checks_recipes_before_any_stage_and_keeps_warnings():
    with pytest.raises(ValueError, match=r"draft.data.sampled_fraction: 2.0 is outside \[0, 1\]"):
        check_stage_configs(compose(["pipeline=smoke", "pipeline.data.sampled_fraction=2.0"]))
    with pytest.raises(ValueError, match="draft.draft_vocab_size: 9999"):
        check_stage_configs(compose(["pipeline=smoke", "+pipeline.drafts.eagle3.draft_vocab_size=9999"]))
    warnings = check_stage_configs(compose(["pipeline=smoke", "pipeline.drafts.eagle3.ttt_steps=1"]))
    assert any("ttt_steps=1" in w for w in warnings)
    with pytest.raises(ValueError, match=r"draft.train_temperatures: \[0.5\] names \[0.5\]"):
        check_stage_configs(compose(["pipeline=smoke", "pipeline.drafts.medusa.train_temperatures=[0.5]"]))
    warnings = check_stage_configs(compose(["pipeline=smoke", "pipeline.eval.temperatures_of.medusa=[0.0,1.0]"]))
    assert any("medusa: draft.train_temperatures=[0.0]" in w and "T=[1.0]" in w for w in warnings)
    assert check_stage_configs(compose(["pipeline=smoke"])) == []
    assert check_stage_configs(compose([])) == []  # the embedded default: TTT >= its largest K


def test_bad_recipe_stops_the_cli_before_the_corpus(tmp_path):
    env = {**os.environ, "DRAFTSMITH_NO_PROGRESS": "1"}
    proc = subprocess.run([sys.executable, "-m", "draftsmith.train.cli", "pipeline", "pipeline=smoke", f"artifacts_root={tmp_path}",
                           "wandb.mode=disabled", "pipeline.data.sampled_fraction=1.5"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "draft.data.sampled_fraction: 1.5 is outside [0, 1]" in proc.stdout + proc.stderr
    assert not (tmp_path / "corpus").exists()


def test_sampled_share_is_the_configured_fraction_in_every_domain():
    data = DraftDataConfig(sampled_fraction=0.5, temperature=0.0, sampled_temperature=1.0)
    temps = [answer_temperature(data, i) for i in range(800)]
    assert set(temps) == {0.0, 1.0}
    for domain in range(4):  # prompts interleave 4 domains round-robin
        share = sum(t == 1.0 for t in temps[domain::4]) / 200
        assert 0.45 <= share <= 0.55
    assert {answer_temperature(DraftDataConfig(sampled_fraction=0.0), i) for i in range(100)} == {0.0}
    assert {answer_temperature(DraftDataConfig(sampled_fraction=1.0), i) for i in range(100)} == {1.0}


def _cache(root: Path, data: DraftDataConfig, extras: StoredExtras, complete: bool = True) -> Path:
    key = cache_key("fp", "tok", "prompts", data, extras)
    manifest = Manifest(key=key, target_fingerprint="fp", tokenizer_hash="tok", prompt_set_hash="prompts",
                        source="target", sampling={}, max_length=data.max_length, shard_size=data.shard_size,
                        num_prompts=4, hidden_size=8, extras=extras, complete=complete,
                        content_key=content_key("fp", "tok", "prompts", data))
    (root / key).mkdir(parents=True)
    manifest.write(root / key)
    return root / key


def test_a_cache_whose_extras_are_a_superset_serves_a_job_needing_less(tmp_path):
    """The pipeline's dataset (hidden + aux + top-k) serves `draftsmith distill draft=standalone` (top-k only)."""
    data = DraftDataConfig(sampled_fraction=0.5, topk_logits=16)
    everything = _cache(tmp_path, data, StoredExtras(final_hidden=True, aux_layers=[2, 10, 17], topk=16))
    content = content_key("fp", "tok", "prompts", data)
    assert find_covering(tmp_path, content, StoredExtras(topk=16)) == everything
    assert find_covering(tmp_path, content, StoredExtras(final_hidden=True)) == everything
    assert find_covering(tmp_path, content, StoredExtras(topk=32)) is None  # needs more than is stored
    greedy = content_key("fp", "tok", "prompts", DraftDataConfig(sampled_fraction=0.0, topk_logits=16))
    assert find_covering(tmp_path, greedy, StoredExtras(topk=16)) is None  # other answers
    smallest = _cache(tmp_path, data, StoredExtras(topk=16))
    assert find_covering(tmp_path, content, StoredExtras(topk=8)) == smallest  # fewest bytes wins
    _cache(tmp_path / "partial", data, StoredExtras(topk=16), complete=False)
    assert find_covering(tmp_path / "partial", content, StoredExtras(topk=16)) is None


def test_reduced_vocab_is_sized_by_coverage():
    counts = torch.zeros(1000)
    counts[:100] = 10.0  # 1000 of 1100 answer tokens in 100 token ids
    counts[100:200] = 1.0
    size, coverage = reduced_vocab_size(counts, None, 0.9)
    assert size == 128 and coverage >= 0.9  # 99 ids are needed; rounded up to a multiple of 64
    size, coverage = reduced_vocab_size(counts, 100, None)
    assert size == 100 and abs(coverage - 1000 / 1100) < 1e-9
    assert reduced_vocab_size(counts, None, None) == (None, 1.0)


def test_trainer_wall_clock_cap_stops_saves_and_logs(tmp_path, caplog):
    sys.path.insert(0, str(REPO / "tests"))
    from distill_toy import ToyDraft, ToyObjective, toy_dataset
    from draftsmith.train.distill.trainer import Trainer
    from draftsmith.train.distill.trainer_config import TrainerConfig

    config = TrainerConfig(output_dir=str(tmp_path), max_steps=100_000, batch_size=4, lr=1e-2, max_minutes=0.002)
    trainer = Trainer(config, ToyObjective(), {"draft": ToyDraft()}, toy_dataset(16, seed=1), toy_dataset(4, seed=2),
                      run_config={"toy": True})
    with caplog.at_level(logging.WARNING, logger="draftsmith"), trainer:
        result = trainer.fit()
    assert result.stopped_by_time_cap and 0 < result.state.step < 100_000
    assert result.checkpoint is not None
    assert any("stopped_by_time_cap=True" in r.getMessage() for r in caplog.records)


def test_bench_recipes_compares_old_new_and_alternatives_in_one_run(tmp_path):
    """scripts/bench_recipes.py on the smoke profile: one table, every standalone recipe at both temperatures."""
    env = {**os.environ, "DRAFTSMITH_NO_PROGRESS": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "scripts/bench_recipes.py", "--artifacts", str(tmp_path), "--kinds",
                           "standalone", "--steps", "2", "--prompts", "1", "--max-tokens", "4"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split()[1]: line.split() for line in proc.stdout.splitlines() if line.startswith("standalone ")}
    assert set(rows) == {"old", "new", "alt-topk", "alt-hidden-tv", "alt-tv", "alt-jsd", "alt-tv-lr", "alt-last",
                         "alt-tv-2l", "alt-2l", "alt-3l", "alt-sampled-half"}
    assert all(cells[2] != "-" and cells[4] != "-" for cells in rows.values()), proc.stdout  # alpha at T=0 and T=1
    # the per-domain table: one row per recipe, alpha(T=1)/tau(T=0)/a_K(T=0) filled for every domain
    per_domain = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines()
                  if line.startswith("standalone:")}
    assert set(per_domain) == {f"standalone:{label}" for label in rows}, proc.stdout
    assert all(len(c.split("/")) == 3 and "-" not in c.split("/") for cells in per_domain.values() for c in cells)
