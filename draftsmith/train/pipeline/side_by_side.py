"""Consecutive ``distill_<kind>`` stages trained side by side, one worker process per lane.

Why: a draft's training step is hundreds of small ops, and a second intra-op thread buys little of a core's
worth. On the 2-core machine, trained two at a time on one thread each against alone on both cores, the steps in
30 s were the standalone draft's 0.73x, EAGLE-1's 0.69-0.74x and Medusa's 0.55x (EAGLE-3 alone on one thread
0.70x, the block draft 0.57x): two kinds trained together each get 1.1-1.5x the steps in the same wall time.
``pipeline.distill_workers`` sets the lanes (1: the stages train one after another in this process, on every
core).

The kinds are dealt longest cap first to the lane with the fewest minutes so far, so lanes end close together;
a worker trains its lane's kinds one after another, exactly what each stage would (``distill.train_draft`` on the stage's ``DraftPlan``), with
``train.num_threads`` set to the cores / workers where it was ``auto``; the stages then run as usual, finding
their drafts exported, and record them (their log line says ``side_by_side``).
"""

from __future__ import annotations

import logging
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any

from omegaconf import open_dict

from draftsmith.train.logs import log_event, progress_lane
from draftsmith.train.pipeline.context import PipelineContext
from draftsmith.train.pipeline.distill import STAGE_PREFIX, DraftPlan, draft_plan, train_draft


def group_at(stage_names: list[str], index: int) -> list[str]:
    """The kinds of the run of consecutive built-in distill stages starting at stage_names[index] ([] if none)."""
    kinds = []
    for name in stage_names[index:]:
        if not name.startswith(STAGE_PREFIX) or ":" in name:
            break
        kinds.append(name[len(STAGE_PREFIX):])
    return kinds


def assign_lanes(plans: list[DraftPlan], lanes: int) -> list[list[DraftPlan]]:
    """Longest cap first (ties in stage order), each to the lane with the fewest minutes so far: the lanes end
    close together. Empty lanes are dropped."""
    assigned: list[list[DraftPlan]] = [[] for _ in range(lanes)]
    load = [0.0] * lanes
    for plan in sorted(plans, key=lambda p: -p.minutes):
        lane = min(range(lanes), key=lambda i: (load[i], i))
        assigned[lane].append(plan)
        load[lane] += plan.minutes
    return [lane for lane in assigned if lane]


def with_threads(plan: DraftPlan, threads: int) -> DraftPlan:
    """The plan with train.num_threads = threads where it was auto (an explicit count is the user's)."""
    if plan.job.train.get("num_threads", "auto") != "auto":
        return plan
    job = plan.job.copy()
    with open_dict(job):
        job.train.num_threads = threads
    return DraftPlan(plan.kind, job, plan.target_dir, plan.fingerprint, plan.data_dir, plan.out_dir, plan.cached)


def _train_lane(position: int, plans: list[DraftPlan]) -> list[str]:
    """A worker: its lane's drafts one after another. Log lines go to stderr tagged with the kind (no Hydra file
    handler in this process), progress bars on their own terminal line. A failure names its stage."""
    kinds = []
    for plan in plans:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr, force=True,
                            format=f"[%(asctime)s][distill {plan.kind}][%(levelname)s] - %(message)s")
        progress_lane(position, plan.kind)
        try:
            train_draft(plan)
        except Exception as error:   # re-raised in the parent: only the message crosses the process boundary
            raise RuntimeError(f"{STAGE_PREFIX}{plan.kind} (trained side by side): {type(error).__name__}: {error}") \
                from None
        kinds.append(plan.kind)
    return kinds


def train_group(ctx: PipelineContext, kinds: list[str], workers: int) -> dict[str, Any]:
    """Train the uncached drafts of `kinds` in `workers` processes; returns the group's log fields."""
    from draftsmith.train.distill.launch import available_cores

    plans = [draft_plan(ctx, kind) for kind in kinds]
    todo = [p for p in plans if not p.cached]
    threads = max(1, available_cores() // workers)
    if len(todo) < 2:   # nothing to overlap: the stages train on every core as usual
        return {"kinds": ",".join(kinds), "trained": len(todo), "workers": 1}
    lanes = assign_lanes([with_threads(p, threads) for p in todo], workers)
    # spawn: a fresh interpreter per worker (a forked one would inherit torch's thread pools and Hydra's state).
    # A failing lane does not stop the others: what they finish is exported (cached for the next run).
    errors: list[BaseException] = []
    with ProcessPoolExecutor(len(lanes), mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(_train_lane, position, lane) for position, lane in enumerate(lanes)]
        for future in as_completed(futures):
            if future.exception() is not None:
                errors.append(future.exception())
                continue
            for kind in future.result():
                ctx.results.trained_side_by_side.add(kind)
                log_event(stage=f"{STAGE_PREFIX}{kind}", status="trained", side_by_side=True)
    if errors:
        raise errors[0]
    return {"kinds": ",".join(kinds), "trained": len(todo), "workers": len(lanes), "threads_per_worker": threads,
            "lanes": " | ".join(",".join(p.kind for p in lane) for lane in lanes)}
