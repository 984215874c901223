"""Side-by-side distill stages: where the group stage goes, how lanes are dealt and threaded, and what the lanes'
workers report (a fake training, so the processes are real and cheap)."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from draftsmith.train.pipeline.distill import DONE_MARKER, DraftPlan
from draftsmith.train.pipeline.side_by_side import GROUP_STAGE, assign_lanes, group_at, plan_stages, run_lanes, with_threads


def plan(kind: str, minutes: float | None, threads: object = "auto", out: Path = Path("/drafts")) -> DraftPlan:
    job = OmegaConf.create({"train": {"max_minutes": minutes, "num_threads": threads}})
    return DraftPlan(kind, job, "target", "fp", "data", out / kind, cached=False)


def fake_train(plan: DraftPlan) -> None:
    """Runs in a worker process: 'bad*' kinds fail as bad input does; the others export a marker."""
    if plan.kind.startswith("bad"):
        raise ValueError(f"draft.init_from: no such dir for {plan.kind}")
    plan.out_dir.mkdir(parents=True)
    (plan.out_dir / DONE_MARKER).write_text("")


def test_a_group_is_the_run_of_consecutive_distill_stages():
    names = ["target", "generate", "distill_standalone", "distill_eagle", "quantize", "distill_block",
             "my.stages:distill_x", "eval"]
    assert group_at(names, 2) == ["standalone", "eagle"]
    assert group_at(names, 3) == ["eagle"]
    assert group_at(names, 5) == ["block"]   # a 'module:function' stage is not a built-in distill stage
    assert group_at(names, 0) == [] and group_at(names, 6) == []
    assert group_at(["distill_eagle", "distill_medusa", "distill_eagle"], 0) == ["eagle", "medusa"]  # no twin lanes


def test_the_group_stage_goes_before_each_run_of_two_or_more_distill_stages():
    stages = [(name, None) for name in ["generate", "distill_standalone", "distill_eagle", "quantize",
                                        "distill_block", "distill_medusa", "eval"]]
    planned = plan_stages(stages, workers=2)
    assert [name for name, _ in planned] == ["generate", GROUP_STAGE, "distill_standalone", "distill_eagle",
                                             "quantize", GROUP_STAGE, "distill_block", "distill_medusa", "eval"]
    assert planned[1][1].keywords == {"kinds": ["standalone", "eagle"], "workers": 2}
    assert planned[5][1].keywords["kinds"] == ["block", "medusa"]
    assert plan_stages(stages, workers=1) == stages
    single = [("generate", None), ("distill_eagle", None), ("eval", None)]
    assert plan_stages(single, workers=2) == single


def test_lanes_are_dealt_longest_cap_first_to_the_least_loaded_lane():
    plans = [plan("standalone", 4.0), plan("medusa", 2.0), plan("eagle", 4.0), plan("eagle3", 5.0), plan("block", 3.5)]
    lanes = assign_lanes(plans, 2)
    assert [[p.kind for p in lane] for lane in lanes] == [["eagle3", "block"], ["standalone", "eagle", "medusa"]]
    assert len(assign_lanes(plans, 8)) == 5   # no empty lanes
    assert [[p.kind for p in lane] for lane in assign_lanes(plans, 1)] == [["eagle3", "standalone", "eagle", "block",
                                                                            "medusa"]]
    uncapped = assign_lanes([plan(k, None) for k in ("a", "b", "c", "d")], 2)   # no caps: spread by count
    assert [[p.kind for p in lane] for lane in uncapped] == [["a", "c"], ["b", "d"]]


def test_workers_share_the_cores_unless_the_count_is_given():
    original = plan("eagle", 1.0)
    shared = with_threads(original, 1)
    assert shared.job.train.num_threads == 1 and shared.out_dir == original.out_dir
    assert original.job.train.num_threads == "auto"   # the stage's own plan is left as it was
    given = plan("eagle", 1.0, threads=3)
    assert with_threads(given, 1) is given


def test_lanes_train_in_their_own_processes(tmp_path):
    lanes = [[plan("eagle3", 2.0, out=tmp_path)], [plan("eagle", 1.0, out=tmp_path), plan("medusa", 1.0, out=tmp_path)]]
    assert sorted(run_lanes(lanes, fake_train, poll_s=0.05)) == ["eagle", "eagle3", "medusa"]
    assert all((tmp_path / kind / DONE_MARKER).is_file() for kind in ("eagle3", "eagle", "medusa"))


def test_a_failing_lane_is_named_its_type_kept_and_the_other_lane_finishes(tmp_path):
    lanes = [[plan("bad_eagle3", 2.0, out=tmp_path), plan("block", 1.0, out=tmp_path)],
             [plan("eagle", 1.0, out=tmp_path)]]
    with pytest.raises(ValueError, match=r"^distill_bad_eagle3 \(trained side by side\): draft.init_from: no such dir"):
        run_lanes(lanes, fake_train, poll_s=0.05)
    assert (tmp_path / "eagle" / DONE_MARKER).is_file()    # the other lane's draft stays exported
    assert not (tmp_path / "block").exists()                # its lane stopped at the failure


def test_a_workers_thread_count_keeps_the_training_run_so_checkpoints_resume():
    """The run dir (where an interrupted training resumes) is keyed by what shapes the weights: a side-by-side
    worker's thread count or another time cap leaves it as the sequential stage's; another learning rate does not.
    The same key names the pipeline's exported draft (drafts/<kind>-<key>)."""
    from omegaconf import open_dict

    from draftsmith.train.config import compose
    from draftsmith.train.distill.launch import LauncherConfig
    from draftsmith.train.distill.run import run_key, run_name
    from draftsmith.train.pipeline.distill import as_dict, job_config

    job = job_config(compose(["pipeline=smoke"]), "eagle")
    launcher = LauncherConfig(**as_dict(job.launcher))
    sequential = run_name(job, "fp", "data-key", launcher)
    worker = with_threads(DraftPlan("eagle", job, "t", "fp", "d", Path("/x"), cached=False), 1).job
    assert worker.train.num_threads == 1 and run_name(worker, "fp", "data-key", launcher) == sequential
    other = job.copy()
    with open_dict(other):
        other.train.max_minutes = 3.0
    assert run_name(other, "fp", "data-key", launcher) == sequential
    other.train.lr = 0.5
    assert run_name(other, "fp", "data-key", launcher) != sequential
    assert sequential.startswith("eagle-") and run_name(job, "fp", "other-data", launcher) != sequential
    assert sequential == f"eagle-{run_key(job, 'fp', 'data-key')}" != run_name(job, "fp2", "data-key", launcher)
