"""Steps 1-3 of the hook: which target is new and which is the baseline, then per old promoted draft:
is it still usable, and did its acceptance regress on the new target (the decision per draft)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from draftsmith.serve_eval.eval.report import ReportSchemaError, load_report
from draftsmith.train.hook import decision as rules
from draftsmith.train.hook.decision import HookError
from draftsmith.train.hook.state import DraftOutcome, HookRun
from draftsmith.train.registry.records import DraftEntry, RegisteredTarget


def resolve_targets(run: HookRun) -> None:
    run.new = RegisteredTarget.from_dir(run.opts.target_path)
    run.record["new_target"] = asdict(run.new)
    run.record_path = run.opts.record_path or run.home("hook", f"decision-{run.stamp}.json")
    run.baseline = _baseline(run)
    run.record["baseline"] = asdict(run.baseline)


def _baseline(run: HookRun) -> RegisteredTarget:
    reg, wanted = run.registry, run.opts.baseline
    if wanted:
        if Path(wanted).is_dir():
            info = RegisteredTarget.from_dir(wanted)
        elif reg.read(wanted) is not None:
            info = reg.read(wanted).target
        else:
            raise HookError(f"baseline={wanted}: no such target directory, and no target with that fingerprint "
                            f"in registry {reg.root}")
        if not reg.promoted(info.fingerprint) and info.fingerprint != run.new.fingerprint:
            raise HookError(f"baseline {wanted} (fingerprint {info.fingerprint}) has no promoted drafts in registry "
                            f"{reg.root}; register them with `draftsmith drafts add ... --status promoted`")
        return info
    others = [fp for fp in reg.fingerprints() if fp != run.new.fingerprint and reg.promoted(fp)]
    if not others:
        raise HookError(f"no baseline: registry {reg.root} has no promoted drafts for another target; "
                        f"pass baseline=OLD_TARGET_DIR")
    latest = max(others, key=lambda fp: max(e.updated_at for e in reg.promoted(fp)))
    return reg.read(latest).target


def assess(run: HookRun) -> None:
    old_entries = run.registry.promoted(run.baseline.fingerprint)
    incompatible = rules.vocab_change(asdict(run.baseline), asdict(run.new))
    run.record["vocab_change"] = incompatible
    for entry in old_entries:
        outcome = DraftOutcome(entry.id, entry.kind, entry.path)
        run.outcomes.append(outcome)
        missing = entry.missing_files()
        if any(not m.startswith("report") for m in missing):
            _fail(run, outcome, f"registry entry {entry.id}: its files are gone ({'; '.join(missing)})")
        elif incompatible:
            scratch = run.opts.policy.from_scratch_on_vocab_change
            outcome.action = "retrain" if scratch else "incompatible"
            outcome.reason = (f"new target changes the vocabulary ({incompatible}): drafts cannot be reused"
                              + ("; retraining from scratch" if scratch else "; set hook.from_scratch=true to "
                                 "retrain from scratch"))
            if not scratch:
                run.errors.append(f"{entry.id}: {outcome.reason}")
            _reference_only(run, entry, outcome)
        else:
            _assess_one(run, entry, outcome)


def _fail(run: HookRun, outcome: DraftOutcome, message: str) -> None:
    outcome.action, outcome.reason = "error", message
    run.errors.append(message)


def _reference(run: HookRun, entry: DraftEntry) -> tuple[list, str] | None:
    """Rows of the draft's last report on the old target and its method label there."""
    if entry.report_path and Path(entry.report_path).is_file():
        try:
            return load_report(entry.report_path).results, entry.report_method or entry.kind
        except ReportSchemaError:
            pass  # fall through: re-measure on the old target when it is still around
    old_dir = run.baseline.path
    if old_dir and Path(old_dir).is_dir():
        with run.timed("evaluate_reference"):
            report = run.collab.evaluator.evaluate(Path(old_dir), {entry.kind: Path(entry.path)},
                                                    run.opts.domains or [], run.opts.profile)
        return report.results, entry.kind
    return None


def _reference_only(run: HookRun, entry: DraftEntry, outcome: DraftOutcome) -> None:
    ref = _reference(run, entry)
    alphas = rules.domain_alphas(*ref) if ref is not None else {}
    for d in run.opts.domains or sorted(alphas):
        outcome.domains[d] = {"old_target": alphas.get(d), "new_target": None, "drop": None, "candidate": None}


def _cannot_run(run: HookRun, outcome: DraftOutcome, ref: tuple[list, str], reason: str) -> None:
    """Retrain from scratch (init_from stays None: the old weights do not fit) on every domain."""
    outcome.action, outcome.reason = "retrain", reason
    alphas = rules.domain_alphas(*ref)
    for d in run.opts.domains or sorted(alphas):
        outcome.domains[d] = {"old_target": alphas.get(d), "new_target": None, "drop": None, "candidate": None}


def _assess_one(run: HookRun, entry: DraftEntry, outcome: DraftOutcome) -> None:
    ref = _reference(run, entry)
    if ref is None:
        return _fail(run, outcome, f"{entry.id}: no usable last report ({entry.report_path}) and the baseline "
                                   f"target dir is unknown or gone, so there is nothing to compare against")
    ref_rows, ref_method = ref
    if not rules.domain_alphas(ref_rows, ref_method):
        return _fail(run, outcome, f"{entry.id}: its last report ({entry.report_path}) has no alpha for method "
                                   f"{ref_method!r}; set the entry's report_method or re-evaluate it")
    domains = run.opts.domains or sorted(rules.domain_alphas(ref_rows, ref_method))
    try:
        run.collab.loader.check(Path(entry.path), run.opts.target_path)
    except ValueError as err:
        return _cannot_run(run, outcome, ref, f"no longer loads on the new target: {err}")
    with run.timed("evaluate_old_drafts"):
        report = run.collab.evaluator.evaluate(run.opts.target_path, {entry.kind: Path(entry.path)},
                                                domains, run.opts.profile)
    outcome.report_new_target = str(run.save_report(report, f"{entry.kind}-old-draft"))
    points = rules.operating_points(report.results, entry.kind)
    if not points:
        skips = [f"{s.domain}: {s.reason}" for s in report.skipped if s.method == entry.kind]
        return _cannot_run(run, outcome, ref, "the eval could not run it on the new target"
                                + (f" ({'; '.join(skips)})" if skips else ""))
    reference = rules.domain_alphas(ref_rows, ref_method, points) or rules.domain_alphas(ref_rows, ref_method)
    current = rules.domain_alphas(report.results, entry.kind, points)
    changes = rules.compare_domains(reference, current, domains)
    outcome.domains = {d: {"old_target": c.before, "new_target": c.after, "drop": c.drop, "candidate": None}
                       for d, c in changes.items()}
    outcome.regressed = rules.regressed_domains(changes, run.opts.policy.regression_threshold)
    drift = run.opts.drift
    if drift is not None and drift.kind in (None, entry.kind):
        outcome.regressed = sorted({*outcome.regressed, drift.domain})
        outcome.action, outcome.init_from, outcome.reason = "retrain", entry.path, drift.reason
        return
    if outcome.regressed:
        outcome.action, outcome.init_from = "retrain", entry.path
        outcome.reason = (f"alpha fell by more than {run.opts.policy.regression_threshold:g} on "
                          f"{', '.join(outcome.regressed)}")
    else:
        outcome.reason = f"no domain fell by more than {run.opts.policy.regression_threshold:g}"
