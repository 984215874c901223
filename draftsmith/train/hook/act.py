"""Steps 4-5 of the hook: regenerate data, re-distill each draft that needs it, evaluate and promote
candidates that hold the bar, carry old drafts over, and close the decision record."""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

from draftsmith.train.hook import decision as rules
from draftsmith.train.hook.state import DraftOutcome, HookRun
from draftsmith.train.registry.records import DraftEntry


def act(run: HookRun) -> None:
    retrain = [o for o in run.outcomes if o.action == "retrain"]
    entries = {e.id: e for e in run.registry.promoted(run.baseline.fingerprint)}
    if retrain:
        from_scratch = any(o.init_from is None for o in retrain)
        domains = sorted({d for o in retrain for d in o.domains})
        regressed = sorted({d for o in retrain for d in o.regressed})
        scope = "all" if from_scratch else run.opts.policy.scope
        plan = rules.data_plan(domains, regressed, scope, run.opts.policy.replay_share)
        run.record["data"] = {"plan": plan, "scope": scope, "path": None}
        if run.opts.dry_run:
            return
        with run.timed("regenerate"):
            data = run.collab.regenerator.regenerate(run.opts.target_path, plan, run.home("data", f"hook-{run.stamp}"))
        run.record["data"]["path"] = str(data)
        for outcome in retrain:
            _retrain(run, outcome, entries[outcome.id], data)
    if not run.opts.dry_run:
        _carry_over(run, entries)


def _retrain(run: HookRun, outcome: DraftOutcome, old: DraftEntry, data: Path) -> None:
    """Recovery rounds (each warm-started from the last candidate) until `rules.recovery_step` stops
    them; the last candidate is then promoted if it holds the bar on every domain."""
    policy = run.opts.policy
    goal = {d: outcome.domains[d]["old_target"] for d in (outcome.regressed or sorted(outcome.domains))}
    start = {d: outcome.domains[d].get("new_target") for d in goal}   # the old draft on the new target
    init_from = Path(outcome.init_from) if outcome.init_from else None
    parent, history, rounds = old, [], []
    while True:
        label = f"{old.kind}-hook-{run.stamp}" + (f"-r{len(history) + 1}" if history else "")
        cand, draft_dir, alphas, report_path = _one_round(run, outcome, old, parent, data, init_from, label)
        history.append(alphas)
        step = rules.recovery_step(history, goal, policy, start)
        rounds.append({"id": cand.id, "path": str(draft_dir), "report": str(report_path), "alphas": alphas})
        if step.stop:
            break
        parent, init_from = cand, draft_dir
    bar = _promotion_bar(outcome, alphas, policy.regression_threshold)
    check = rules.promotion_check(bar, alphas, policy.promote_tolerance)
    if check.promote:
        run.registry.promote(cand.id)
    outcome.candidate = {"id": cand.id, "path": str(draft_dir), "report": str(report_path),
                         "promoted": check.promote, "reason": check.reason, "bar": bar,
                         "recovery": {"rounds": len(rounds), "stopped_by": step.reason, "goal": goal,
                                      "recovered_share": rules.recovered_share(
                                          alphas, goal, start, [d for d in sorted(goal) if goal[d] is not None]),
                                      "history": rounds}}


def _one_round(run: HookRun, outcome: DraftOutcome, old: DraftEntry, parent: DraftEntry, data: Path,
               init_from: Path | None, label: str):
    """Distill one candidate, register it (lineage: parent), evaluate it; (entry, dir, alphas, report)."""
    with run.timed("distill"):
        draft_dir = run.collab.distiller.distill(
            old.kind, run.opts.target_path, data, init_from, out_dir=run.home("drafts", label),
            parent_run=parent.extra.get("wandb_run"))
    cand = run.registry.add(draft_dir, run.new, parent_id=parent.id, note=f"hook {run.stamp}: {outcome.reason}",
                            extra={"hook_record": str(run.record_path)})
    with run.timed("evaluate_candidates"):
        report = run.collab.evaluator.evaluate(run.opts.target_path, {old.kind: Path(draft_dir)},
                                               sorted(outcome.domains), run.opts.profile)
    report_path = run.save_report(report, label.replace(f"-hook-{run.stamp}", "-candidate"))
    lineage = _log_lineage(run, data, Path(draft_dir), report_path, parent)
    cand = run.registry.update(cand.id, report_path=str(report_path), report_method=old.kind, lineage=lineage)
    return cand, draft_dir, rules.domain_alphas(report.results, old.kind), report_path


def _log_lineage(run: HookRun, data: Path, draft_dir: Path, report_path: Path, parent: DraftEntry) -> list:
    """target -> data -> draft -> report as W&B artifacts (the draft also uses its warm-start parent's).
    A W&B failure costs the lineage, not the candidate: it is noted in the record."""
    parents = [ref for ref in parent.lineage if ref.type == "draft"]
    try:
        with run.timed("lineage"):
            return run.collab.lineage.log_chain(run.new, data, draft_dir, report_path, parents)
    except Exception as err:  # noqa: BLE001 - W&B's own errors are many and unrelated to the draft
        run.record.setdefault("lineage_errors", []).append(f"{draft_dir.name}: {type(err).__name__}: {err}")
        return []


def _promotion_bar(outcome: DraftOutcome, alphas: dict[str, float], threshold: float) -> dict[str, float | None]:
    """Per domain, what the candidate must reach: the old draft on the new target, or (where the old
    draft cannot run there) its old level less the regression threshold."""
    bar: dict[str, float | None] = {}
    for d, row in outcome.domains.items():
        row["candidate"] = alphas.get(d)
        if row["new_target"] is not None:
            bar[d] = row["new_target"]
        elif row["old_target"] is not None:
            bar[d] = max(0.0, row["old_target"] - threshold)
    return bar


def _carry_over(run: HookRun, entries: dict[str, DraftEntry]) -> None:
    """An old draft that still runs keeps serving the new target unless a promoted candidate replaced it."""
    if run.new.fingerprint == run.baseline.fingerprint:
        return
    for o in run.outcomes:
        replaced = bool(o.candidate and o.candidate["promoted"])
        if o.report_new_target is None or replaced or o.action in ("error", "incompatible"):
            continue
        if any(Path(e.path) == Path(o.path) for e in run.registry.entries(run.new.fingerprint)):
            continue
        carried = run.registry.add(o.path, run.new, report_path=o.report_new_target, report_method=o.kind,
                                    status="promoted", parent_id=o.id, note=f"carried over by hook {run.stamp}")
        o.candidate = (o.candidate or {}) | {"carried_over_as": carried.id}


def finish(run: HookRun, started: float) -> int:
    retrained = [o for o in run.outcomes if o.candidate and "id" in o.candidate]
    promoted = [o for o in retrained if o.candidate["promoted"]]
    code = rules.exit_code(run.errors, len(retrained), len(promoted))
    if run.opts.dry_run and code != rules.EXIT_ERROR:
        code = rules.EXIT_OK
    needed = any(o.action == "retrain" for o in run.outcomes)
    outcome = ("error" if code == rules.EXIT_ERROR else "dry_run" if run.opts.dry_run
               else "not_promoted" if code == rules.EXIT_NOT_PROMOTED else "promoted" if retrained
               else "nothing_needed")
    run.timings["total"] = time.perf_counter() - started
    run.record.update(drafts=[asdict(o) for o in run.outcomes], retrain_needed=needed, errors=run.errors,
                       outcome=outcome, exit_code=code, timings_s={k: round(v, 3) for k, v in run.timings.items()})
    return code
