"""The hook logs each recovery round's lineage to W&B (offline): the candidate's registry entry holds
target -> data -> draft -> report, a later round's draft uses the earlier round's, and the chain read
back from the offline run files is the registry's. A W&B failure costs the lineage, not the candidate."""
from __future__ import annotations

import pytest

from hook_fakes import NEW_CODE_DROP, CurveDistiller, FakeEvaluator, FakeLoader, FakeRegenerator
from draftsmith.train.hook import decision as rules
from draftsmith.train.hook.cli import run_hook
from draftsmith.train.hook.collaborators import Collaborators
from draftsmith.train.hook.state import HookOptions
from draftsmith.train.logs import WandbSettings
from draftsmith.train.registry.lineage import WandbLineage, logged_chain

pytest.importorskip("wandb")

REST = {"chat": 0.70, "math": 0.675, "prose": 0.72}


def run(world, lineage, curve):
    collab = Collaborators(FakeEvaluator(), FakeRegenerator(), CurveDistiller(curve), FakeLoader(), lineage)
    options = HookOptions(target_path=world.new, registry_root=world.registry.root,
                          policy=rules.HookPolicy(max_rounds=2))
    return run_hook(options, collab)


def test_each_round_logs_its_chain_and_the_rounds_link_up(world):
    world.install(NEW_CODE_DROP)
    wandb_dir = world.tmp / "wandb"
    code, record, _ = run(world, WandbLineage(WandbSettings(mode="offline", project="hook-lineage"), wandb_dir),
                          [{**REST, "code": 0.66}, {**REST, "code": 0.74}])
    assert code == 0 and "lineage_errors" not in record, record.get("lineage_errors")
    first, second = (world.registry.get(r["id"]) for r in record["drafts"][0]["candidate"]["recovery"]["history"])
    for entry in (first, second):
        assert [ref.type for ref in entry.lineage] == ["target", "dataset", "draft", "report"]
        target_ref, data_ref, draft_ref, report_ref = entry.lineage
        assert target_ref.name == f"target-{record['new_target']['fingerprint']}"
        assert data_ref.uses == (target_ref.key,) and report_ref.uses == (draft_ref.key, target_ref.key)
        chain = logged_chain(wandb_dir, report_ref)          # read back from the offline run files
        assert [(a.name, a.digest) for a in chain] == [(r.name, r.digest) for r in entry.lineage]
        assert chain[2].metadata["path"] == entry.path
    assert first.lineage[:2] == second.lineage[:2]             # one target, one dataset for both rounds
    assert first.lineage[2].key in second.lineage[2].uses      # round 2 was warm-started from round 1


class BrokenLineage:
    def log_chain(self, *args, **kwargs):
        raise RuntimeError("wandb-core exited")


def test_a_lineage_failure_is_recorded_and_the_candidate_still_promoted(world):
    world.install(NEW_CODE_DROP)
    code, record, _ = run(world, BrokenLineage(), [{**REST, "code": 0.74}])
    assert code == 0 and record["outcome"] == "promoted"
    assert len(record["lineage_errors"]) == 1 and "wandb-core exited" in record["lineage_errors"][0]
    assert world.registry.get(record["drafts"][0]["candidate"]["id"]).lineage == []
