"""The retrain-hook demonstration end to end on tiny models: a tiny target is trained here, a tiny EAGLE
draft is distilled from it and promoted, the target is fine-tuned on one domain (a target update), and the
hook runs with the REAL collaborators (eval harness, data regeneration, warm-started distillation).

Alphas on models this small are not meaningful; what is checked is the flow and its bookkeeping: a new
fingerprint, a decision record whose exit code matches the hook's, registry state that follows the
record, and a demo table whose figures are the record's."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from distill_fixtures import make_corpus, make_target

os.environ.setdefault("DRAFTSMITH_NO_PROGRESS", "1")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from demo_target_update import DemoConfig, run_demo
    from draftsmith.train.finetune import FinetuneConfig

    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("hook_e2e")
    target = make_target(tmp / "target", train_steps=40)
    corpus = make_corpus(tmp / "corpus.jsonl", per_domain=24)
    cfg = DemoConfig(artifacts_root=str(tmp / "artifacts"), target=str(target), kinds=["eagle"], domain="code",
                     threshold=0.0, max_prompts=16, max_new_tokens=8, max_length=48, steps=6, hook_steps=3,
                     batch_size=8, lr=1e-2, eval_prompts=2, eval_tokens=8,
                     finetune=FinetuneConfig(steps=12, lr=1e-2, batch_size=4, seq_len=24, warmup_steps=2,
                                             bf16_autocast=False, num_threads=1))
    extra = [f"data.path={corpus}", "data.eval_per_domain=2", "data.distill_per_domain=20",
             "target.eval_records_per_domain=2", "eval.engine.kv_cache_memory_gb=0.02", "++train.eval_batch_size=4"]
    summary = run_demo(cfg, extra)
    return tmp, target, summary


def test_target_update_gives_a_new_fingerprint_with_lineage(demo):
    """The fine-tuned target is a new checkpoint (other fingerprint, same vocabulary) that names its base."""
    from draftsmith.drafts.identity import target_fingerprint

    tmp, target, summary = demo
    new_dir = Path(summary["new_target"])
    assert target_fingerprint(new_dir) == summary["new_fingerprint"] != target_fingerprint(target)
    meta = json.loads((new_dir / "draftsmith_target.json").read_text())
    assert meta["finetuned_from"]["fingerprint"] == target_fingerprint(target)
    assert meta["finetune"]["domain"] == "code" and meta["steps"] == 12
    assert json.loads((new_dir / "config.json").read_text())["vocab_size"] == 96


def test_decision_record_and_exit_code_agree(demo):
    """The hook wrote its record; its exit code is 0 or 3 and says what the record says about promotion."""
    _, _, summary = demo
    record = json.loads(Path(summary["decision_record"]).read_text())
    assert record["errors"] == [], record["errors"]
    assert summary["hook_exit"] == record["exit_code"] in (0, 3)
    (draft,) = record["drafts"]
    assert draft["kind"] == "eagle" and set(draft["domains"]) == {"code", "prose", "math", "chat"}
    for values in draft["domains"].values():  # the old draft ran on both targets
        assert values["old_target"] is not None and values["new_target"] is not None
    if draft["action"] == "retrain":
        cand = draft["candidate"]
        assert Path(cand["path"], "draftsmith.json").is_file()
        assert record["exit_code"] == (0 if cand["promoted"] else 3)
        assert record["outcome"] == ("promoted" if cand["promoted"] else "not_promoted")
        assert record["data"]["plan"] and Path(record["data"]["path"], "manifest.json").is_file()
    else:
        assert record["exit_code"] == 0 and record["outcome"] == "nothing_needed"


def test_registry_follows_the_record(demo):
    """Old target: the demo's promoted draft. New target: the candidate is promoted iff the record says so,
    else the old draft is carried over as the promoted one; the candidate was warm-started (its metrics
    name the old draft's run lineage field) and trained for the hook's step budget."""
    from draftsmith.train.registry.store import Registry

    tmp, _, summary = demo
    registry = Registry(tmp / "artifacts")
    (old,) = registry.promoted(summary["old_fingerprint"])
    (now,) = registry.promoted(summary["new_fingerprint"])
    draft = json.loads(Path(summary["decision_record"]).read_text())["drafts"][0]
    cand = draft.get("candidate") or {}
    if cand.get("promoted"):
        # Recovery rounds chain their candidates: the promoted one descends from the old draft.
        assert now.id == cand["id"]
        lineage, entry = [], now
        while entry.parent_id is not None and len(lineage) < 10:
            entry = registry.get(entry.parent_id)
            lineage.append(entry.id)
        assert lineage[-1] == old.id and len(lineage) == cand["recovery"]["rounds"]
        meta = json.loads(Path(now.path, "draftsmith.json").read_text())
        assert meta["metrics"]["steps"] == 3
    else:
        assert Path(now.path) == Path(old.path)


def test_demo_table_carries_the_record_figures(demo):
    """Every alpha of the printed table is the record's, the recovered share is (cand - new)/(old - new),
    and the from-scratch baseline was timed when the hook retrained."""
    from demo_target_update import render

    _, _, summary = demo
    draft = json.loads(Path(summary["decision_record"]).read_text())["drafts"][0]
    for row in summary["rows"]:
        v = draft["domains"][row["domain"]]
        assert (row["old_draft_old_target"], row["old_draft_new_target"], row["redistilled_new_target"]) == \
            (v["old_target"], v["new_target"], v["candidate"])
        if row["recovered"] is not None:
            assert row["recovered"] == pytest.approx((v["candidate"] - v["new_target"]) / (v["old_target"] - v["new_target"]))
    if draft["action"] == "retrain":
        assert summary["scratch"]["wall_s"] > 0 and set(summary["scratch"]["alphas"]) == {"eagle"}
    table = render(summary)
    assert "| eagle | code" in table and "Hook: exit" in table and "fine-tuned on code for 12 steps" in table
    assert "95% bootstrap interval over prompts" in table
    for row in summary["rows"]:       # every measured cell carries the harness's interval over its 2 prompts
        for cell, value in (("old", row["old_draft_old_target"]), ("new", row["old_draft_new_target"])):
            low, high = row["ci"][cell]
            assert low - 1e-9 <= value <= high + 1e-9


def test_the_candidates_lineage_is_logged_offline_and_reads_back(demo):
    """W&B offline (the demo's default): the hook's candidate carries target -> data -> draft -> report in
    the registry, and the offline run files under the artifacts' wandb dir hold the same chain."""
    from draftsmith.train.registry.lineage import logged_chain
    from draftsmith.train.registry.store import Registry

    tmp, _, summary = demo
    draft = json.loads(Path(summary["decision_record"]).read_text())["drafts"][0]
    if draft["action"] != "retrain":
        pytest.skip("the hook retrained nothing on this tiny update")
    registry = Registry(tmp / "artifacts")
    entry = registry.get(draft["candidate"]["id"])
    (old,) = registry.promoted(summary["old_fingerprint"])       # the demo's initial draft logs its chain too
    assert [r.type for r in entry.lineage] == [r.type for r in old.lineage] == ["target", "dataset", "draft", "report"]
    chain = logged_chain(tmp / "artifacts" / "wandb", entry.lineage[-1])
    assert [(a.name, a.digest) for a in chain] == [(r.name, r.digest) for r in entry.lineage]
    assert chain[0].metadata["fingerprint"] == summary["new_fingerprint"]


def test_planned_records_keep_the_full_jobs_prompts_per_share():
    """A regressed domain (share 1) gets exactly the prompts a from-scratch job would use; a replayed one
    (share 0.25) a prefix of them; a domain outside the plan none; a share outside [0, 1] is refused."""
    from draftsmith.train.distill.dataset.settings import interleave_domains
    from draftsmith.train.hook.jobs import planned_records

    records = [{"domain": d, "prompt": f"{d}{i}", "reference": ""} for d in ("code", "math", "chat") for i in range(10)]
    full = interleave_domains(records, 24)  # 8 per domain
    out = planned_records(records, {"code": 1.0, "math": 0.25}, 24)
    assert [r["prompt"] for r in out if r["domain"] == "code"] == [r["prompt"] for r in full if r["domain"] == "code"]
    assert [r["prompt"] for r in out if r["domain"] == "math"] == ["math0", "math1"]
    assert not any(r["domain"] == "chat" for r in out)
    with pytest.raises(ValueError, match="shares must be in"):
        planned_records(records, {"code": 1.5}, None)
    with pytest.raises(ValueError, match="no distill prompts for domain"):
        planned_records(records, {"legal": 1.0}, None)


def test_finetune_bad_input_names_the_field(tmp_path):
    """An unknown domain names the corpus's domains; writing over the base target is refused."""
    from draftsmith.train.finetune import FinetuneConfig, domain_texts, finetune

    with pytest.raises(ValueError, match="domain 'legal'.*code, math"):
        domain_texts([{"domain": "code", "prompt": "a", "reference": "b"},
                      {"domain": "math", "prompt": "c", "reference": "d"}], "legal")
    target = make_target(tmp_path / "t")
    with pytest.raises(ValueError, match="--out"):
        finetune(target, target, ["w1 w2"], FinetuneConfig())
    with pytest.raises(ValueError, match="finetune.steps"):
        finetune(target, tmp_path / "new", ["w1 w2"], FinetuneConfig(steps=0))
