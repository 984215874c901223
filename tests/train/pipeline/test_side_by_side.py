"""Side-by-side distill stages: which stages group, the order lanes take them in, the thread count per worker."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from draftsmith.train.pipeline.distill import DraftPlan
from draftsmith.train.pipeline.side_by_side import assign_lanes, group_at, with_threads


def plan(kind: str, minutes: float | None, threads: object = "auto") -> DraftPlan:
    job = OmegaConf.create({"train": {"max_minutes": minutes, "num_threads": threads}})
    return DraftPlan(kind, job, "target", "fp", "data", Path(f"/drafts/{kind}"), cached=False)


def test_a_group_is_the_run_of_consecutive_distill_stages():
    names = ["target", "generate", "distill_standalone", "distill_eagle", "quantize", "distill_block",
             "my.stages:distill_x", "eval"]
    assert group_at(names, 2) == ["standalone", "eagle"]
    assert group_at(names, 3) == ["eagle"]
    assert group_at(names, 5) == ["block"]   # a 'module:function' stage is not a built-in distill stage
    assert group_at(names, 0) == [] and group_at(names, 6) == []


def test_lanes_are_dealt_longest_cap_first_to_the_least_loaded_lane():
    plans = [plan("standalone", 4.0), plan("medusa", 2.0), plan("eagle", 4.0), plan("eagle3", 5.0), plan("block", 3.5)]
    lanes = assign_lanes(plans, 2)
    assert [[p.kind for p in lane] for lane in lanes] == [["eagle3", "block"], ["standalone", "eagle", "medusa"]]
    assert sorted(p.kind for lane in assign_lanes(plans, 8) for p in lane) == sorted(p.kind for p in plans)
    assert len(assign_lanes(plans, 8)) == 5   # no empty lanes
    assert [[p.kind for p in lane] for lane in assign_lanes(plans, 1)] == [["eagle3", "standalone", "eagle", "block",
                                                                            "medusa"]]


def test_workers_share_the_cores_unless_the_count_is_given():
    shared = with_threads(plan("eagle", 1.0), 1)
    assert shared.job.train.num_threads == 1 and shared.out_dir == Path("/drafts/eagle")
    assert plan("eagle", 1.0).job.train.num_threads == "auto"   # the stage's own plan is left as it was
    assert with_threads(plan("eagle", 1.0, threads=3), 1).job.train.num_threads == 3
