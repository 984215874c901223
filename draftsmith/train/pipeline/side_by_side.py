"""Consecutive ``distill_<kind>`` stages trained side by side, one worker process per lane.

Why: a draft's training step is hundreds of small ops, and a second intra-op thread buys little of a core's
worth. On the 2-core machine, trained two at a time on one thread each against alone on both cores, the steps in
30 s were the standalone draft's 0.73x, EAGLE-1's 0.69-0.74x and Medusa's 0.55x (EAGLE-3 alone on one thread
0.70x, the block draft 0.57x). In a main job, lanes of 9 and 10 minutes against 9.25 minutes in sequence
trained each kind 1.05x (block) to 1.8x (EAGLE-1) the steps.
``pipeline.distill_workers`` sets the lanes (1: the stages train one after another in this process, on every
core).

``plan_stages`` puts a ``distill_side_by_side`` stage before each run of consecutive distill stages. It deals the
uncached kinds longest cap first to the lane with the fewest minutes (then the fewest kinds) so far, so lanes end
close together; each lane's worker trains its kinds one after another, exactly what each stage would
(``distill.train_draft`` on the stage's ``DraftPlan``), on cores / lanes threads where ``train.num_threads`` is
auto. The distill stages then run as usual, find their drafts exported, and record them.
"""

from __future__ import annotations

import dataclasses
import functools
import multiprocessing
import queue
from collections.abc import Callable, Sequence
from typing import Any

from omegaconf import open_dict

from draftsmith.train.logs import log_event, progress_lane
from draftsmith.train.pipeline.context import PipelineContext
from draftsmith.train.pipeline.distill import STAGE_PREFIX, DraftPlan, draft_plan, train_draft
from draftsmith.train.worker_process import (configure_child_logging, log_worker_failure, parent_log_files,
                                             portable_error)

GROUP_STAGE = "distill_side_by_side"
Train = Callable[[DraftPlan], None]


def group_at(stage_names: Sequence[str], index: int) -> list[str]:
    """The kinds of the run of consecutive built-in distill stages starting at stage_names[index] ([] if none); a
    kind named twice ends the run (its second stage is a cache hit of the first, not a second training)."""
    kinds: list[str] = []
    for name in stage_names[index:]:
        kind = name[len(STAGE_PREFIX):]
        if not name.startswith(STAGE_PREFIX) or ":" in name or kind in kinds:
            break
        kinds.append(kind)
    return kinds


def plan_stages(stages: Sequence[tuple[str, Any]], workers: int) -> list[tuple[str, Any]]:
    """`stages` with a side-by-side stage before each run of 2+ consecutive distill stages (workers > 1)."""
    if workers <= 1:
        return list(stages)
    names, planned, index = [name for name, _ in stages], [], 0
    while index < len(stages):
        kinds = group_at(names, index)
        if len(kinds) > 1:
            planned.append((GROUP_STAGE, functools.partial(train_group, kinds=kinds, workers=workers)))
        span = max(1, len(kinds))
        planned.extend(stages[index:index + span])
        index += span
    return planned


def assign_lanes(plans: list[DraftPlan], lanes: int) -> list[list[DraftPlan]]:
    """Longest cap first (ties in stage order), each to the lane with the fewest minutes, then the fewest kinds,
    so far (uncapped kinds spread evenly). Empty lanes are dropped."""
    assigned: list[list[DraftPlan]] = [[] for _ in range(lanes)]
    load = [0.0] * lanes
    for plan in sorted(plans, key=lambda p: -p.minutes):
        lane = min(range(lanes), key=lambda i: (load[i], len(assigned[i]), i))
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
    return dataclasses.replace(plan, job=job)


def named(error: BaseException, kind: str) -> BaseException:
    """`error` with the stage it failed in leading its message (its type kept, so bad input stays one line)."""
    where = f"{STAGE_PREFIX}{kind} (trained side by side)"
    if isinstance(error, OSError) and error.strerror:
        error.strerror = f"{where}: {error.strerror}"
    elif error.args and isinstance(error.args[0], str):
        error.args = (f"{where}: {error.args[0]}", *error.args[1:])
    else:
        error.add_note(where)
    return error


def _lane_main(position: int, plans: list[DraftPlan], events: Any, log_files: list[str], train: Train) -> None:
    """A worker: its lane's drafts one after another, each reported on `events` as (kind, None) or (kind, error);
    a failure ends the lane. Log lines go to stderr and the run's log files, tagged with the kind."""
    for plan in plans:
        configure_child_logging(log_files, f"[%(asctime)s][distill {plan.kind}][%(levelname)s] - %(message)s")
        progress_lane(position, plan.kind)
        try:
            train(plan)
        except Exception as error:
            log_worker_failure(error, f"{STAGE_PREFIX}{plan.kind}")
            events.put((plan.kind, portable_error(error)))
            return
        events.put((plan.kind, None))


def run_lanes(lanes: list[list[DraftPlan]], train: Train = train_draft, poll_s: float = 0.5) -> list[str]:
    """Each lane in its own spawned process; returns the kinds trained, in the order they finished. The first
    failure is raised (named, after every lane has ended: what the others finish stays exported); a lane whose
    process died names the kinds it left. An interrupt of this process stops every worker."""
    context = multiprocessing.get_context("spawn")   # a forked worker would inherit torch's pools and Hydra's state
    events = context.Queue()
    log_files = parent_log_files()
    workers = [context.Process(target=_lane_main, args=(i, lane, events, log_files, train), name=f"distill-lane-{i}")
               for i, lane in enumerate(lanes)]
    pending = {plan.kind for lane in lanes for plan in lane}
    trained: list[str] = []
    failures: list[BaseException] = []
    try:
        for worker in workers:
            worker.start()
        while pending and (any(w.is_alive() for w in workers) or not events.empty()):
            try:
                kind, error = events.get(timeout=poll_s)
            except queue.Empty:
                continue
            pending.discard(kind)
            if error is None:
                trained.append(kind)
                log_event(stage=f"{STAGE_PREFIX}{kind}", status="trained", side_by_side=True)
            else:
                failures.append(named(error, kind))
                log_event(stage=f"{STAGE_PREFIX}{kind}", status="failed", side_by_side=True, error=str(error))
        for worker in workers:
            worker.join()
    except BaseException:
        for worker in workers:
            if worker.is_alive():
                worker.terminate()
        for worker in workers:
            worker.join()
        raise
    died = [(w, [p.kind for p in lane if p.kind in pending]) for w, lane in zip(workers, lanes)]
    died = [(w, kinds) for w, kinds in died if kinds and w.exitcode != 0]
    if failures:
        raise failures[0]
    if died:
        worker, kinds = died[0]
        raise RuntimeError(f"{GROUP_STAGE}: the worker training {', '.join(kinds)} died (exit code {worker.exitcode}); "
                           "rerun the pipeline to train what is left")
    return trained


def train_group(ctx: PipelineContext, kinds: list[str], workers: int, train: Train = train_draft) -> dict[str, Any]:
    """The side-by-side stage: train the uncached drafts of `kinds` in up to `workers` lanes; its log fields."""
    from draftsmith.train.distill.launch import available_cores

    todo = [plan for plan in (draft_plan(ctx, kind) for kind in kinds) if not plan.cached]
    cores = available_cores()
    if len(todo) < 2 or min(workers, cores) < 2:   # nothing to overlap: the stages train on every core as usual
        return {"kinds": ",".join(kinds), "trained": 0, "workers": 0}
    lanes = assign_lanes(todo, min(workers, cores))   # a lane per core at most: two on one core only halve each
    threads = max(1, cores // len(lanes))
    lanes = [[with_threads(plan, threads) for plan in lane] for lane in lanes]
    ctx.results.trained_side_by_side.update(run_lanes(lanes, train))
    return {"kinds": ",".join(kinds), "trained": len(todo), "workers": len(lanes), "threads_per_worker": threads,
            "lanes": " | ".join(",".join(p.kind for p in lane) for lane in lanes)}
