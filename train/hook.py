"""``draftsmith hook target-updated target.path=NEW [baseline=OLD] [--dry-run]``: drafts follow their target.

When a target is fine-tuned, its drafts' acceptance can fall on the slices it moved. This hook:

1. fingerprints the new target and finds the promoted drafts of the baseline (``baseline=`` dir or
   fingerprint; default: the registry's most recently promoted other target);
2. a new tokenizer/vocab means the drafts cannot be reused: stop (exit 2), or retrain from scratch
   when ``hook.from_scratch=true``;
3. evaluates each old draft on the new target per domain; a domain regressed when its alpha fell by
   more than ``hook.threshold`` (default 0.05 = 5 points) from the draft's last report on the old
   target; a draft that no longer loads (shape change) is retrained from scratch;
4. regenerates data with the new target (regressed domains + a replay share of the others, or all),
   re-distills warm-started from the old draft (``init_from``), evaluates the candidate, and promotes
   it only if it is at least the old draft on every domain within ``hook.tolerance``;
5. writes a decision record JSON and exits 0 (nothing needed / promoted), 3 (retrained, not
   promoted) or 2 (error). ``--dry-run`` stops after the decision, trains nothing, changes nothing.

The heavy collaborators (eval harness, data generation, distillation) sit behind three small
protocols below, wired by name to their modules and imported only when called, so the decision
logic is tested with scripted fakes; the rules themselves live in ``train.hook_decision``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

from drafts.artifacts import Artifacts
from drafts.files import atomic_write_text
from serve_eval.eval.report import Report, ReportSchemaError, load_report
from serve_eval.eval.report_files import write_report
from train import hook_decision as rules
from train.registry import (DEFAULT_LOCK_TIMEOUT_S, DraftEntry, Registry, RegistryLockedError, TargetInfo,
                            registry_root, split_key_values, utc_now)

RECORD_SCHEMA_VERSION = 1


class HookError(ValueError):
    """Bad input or a state the hook cannot act on; the message says which."""


# ----------------------------------------------------------------------------- collaborators

class Evaluator(Protocol):
    def evaluate(self, target_dir: Path, drafts: dict[str, Path], domains: list[str], profile: str) -> Report:
        """Eval ``drafts`` (method label -> draft dir) on the target; rows of a draft carry its label as `method`."""


class Regenerator(Protocol):
    def regenerate(self, target_dir: Path, plan: dict[str, float], out_dir: Path) -> Path:
        """Answer the distill prompts with the target; ``plan`` = share of each domain's prompts. Returns the data dir."""


class Distiller(Protocol):
    def distill(self, kind: str, target_dir: Path, data: Path, init_from: Path | None, *, out_dir: Path,
                parent_run: str | None = None) -> Path:
        """Train a ``kind`` draft on ``data`` (warm-started from ``init_from``); returns the draft dir."""


class DraftLoader(Protocol):
    def check(self, draft_dir: Path, target_dir: Path) -> None:
        """Raise ValueError when the draft cannot run on this target (vocab/hidden/layer shapes)."""


# train.hook_jobs adapts generate/distill (which choose their own cache dirs) to these keyword calls;
# the harness's evaluate loads old drafts with strict_fingerprint=False all the way to the proposers.
DEFAULT_SPECS = {"evaluator": "serve_eval.eval.harness:evaluate",
                 "regenerator": "train.hook_jobs:regenerate",
                 "distiller": "train.hook_jobs:distill"}


class _Named:
    """A collaborator function named 'module:function', imported at its first call."""

    def __init__(self, role: str, spec: str, overrides: list[str]):
        self.role, self.spec, self.overrides = role, spec, overrides

    def __call__(self, **kwargs: Any) -> Any:
        module_name, _, attr = self.spec.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name is not None and module_name.startswith(err.name):
                raise HookError(f"hook {self.role} {self.spec}: {module_name} is not in this checkout yet") from None
            raise
        fn = getattr(module, attr, None)
        if fn is None:
            raise HookError(f"hook {self.role} {self.spec}: {module_name} has no {attr}")
        return fn(**kwargs, overrides=self.overrides)


class NamedEvaluator(_Named):
    def evaluate(self, target_dir, drafts, domains, profile):
        return self(target_dir=target_dir, drafts=drafts, domains=domains, profile=profile)


class NamedRegenerator(_Named):
    def regenerate(self, target_dir, plan, out_dir):
        return Path(self(target_dir=target_dir, plan=plan, out_dir=out_dir))


class NamedDistiller(_Named):
    def distill(self, kind, target_dir, data, init_from, *, out_dir, parent_run=None):
        return Path(self(kind=kind, target_dir=target_dir, data=data, init_from=init_from, out_dir=out_dir,
                         parent_run=parent_run))


class DraftIOLoader:
    """drafts.io.load_draft against the target's sizes (not its fingerprint: it changed, that is the point)."""

    def check(self, draft_dir: Path, target_dir: Path) -> None:
        from drafts.io import ExpectedTarget, load_draft

        loaded = load_draft(draft_dir, ExpectedTarget.from_config(target_dir, None))
        aux = getattr(loaded.model.config, "aux_layers", None)
        num_layers = json.loads((Path(target_dir) / "config.json").read_text()).get("num_hidden_layers")
        if aux and num_layers is not None and max(aux) > num_layers:
            raise ValueError(f"{draft_dir}: eagle3 draft reads target hidden states {aux}, but the target has only "
                             f"{num_layers} layers")


@dataclass
class Collaborators:
    evaluator: Evaluator
    regenerator: Regenerator
    distiller: Distiller
    loader: DraftLoader = field(default_factory=DraftIOLoader)

    @classmethod
    def real(cls, specs: dict[str, str] | None = None, overrides: list[str] | None = None) -> "Collaborators":
        """The real jobs by name (``hook.evaluator=module:function`` etc. replace them); overrides reach each."""
        specs, overrides = {**DEFAULT_SPECS, **(specs or {})}, list(overrides or [])
        loader = DraftIOLoader()
        if "loader" in specs:
            module_name, _, attr = specs["loader"].partition(":")
            loader = getattr(importlib.import_module(module_name), attr)()
        return cls(NamedEvaluator("evaluator", specs["evaluator"], overrides),
                   NamedRegenerator("regenerator", specs["regenerator"], overrides),
                   NamedDistiller("distiller", specs["distiller"], overrides), loader)


@dataclass
class HookOptions:
    target_path: Path
    registry_root: Path
    baseline: str | None = None
    policy: rules.HookPolicy = field(default_factory=rules.HookPolicy)
    profile: str = "quick"              # eval profile passed to the evaluator
    domains: list[str] | None = None    # None: the domains of each draft's last report
    lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S
    dry_run: bool = False
    record_path: Path | None = None     # None: <registry>/targets/<new fp>/hook/decision-<stamp>.json


@dataclass
class DraftOutcome:
    """One old draft's path through the hook (a part of the decision record)."""

    id: str
    kind: str
    path: str
    action: str = "keep"                # keep | retrain | incompatible | error
    reason: str = ""
    init_from: str | None = None
    regressed: list[str] = field(default_factory=list)
    # domain -> {"old_target": alpha, "new_target": alpha, "drop": ..., "candidate": alpha}
    domains: dict[str, dict[str, float | None]] = field(default_factory=dict)
    report_new_target: str | None = None
    candidate: dict[str, Any] | None = None


class _Run:
    """One hook invocation: the state the steps share, and the record they fill."""

    def __init__(self, opts: HookOptions, collab: Collaborators, registry: Registry):
        self.opts, self.collab, self.registry = opts, collab, registry
        self.stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
        self.timings: dict[str, float] = {}
        self.errors: list[str] = []
        self.outcomes: list[DraftOutcome] = []
        self.record_path: Path | None = opts.record_path
        self.record: dict[str, Any] = {"schema_version": RECORD_SCHEMA_VERSION, "created": utc_now(),
                                       "dry_run": opts.dry_run, "policy": asdict(opts.policy),
                                       "profile": opts.profile, "registry": str(registry.root)}

    @contextlib.contextmanager
    def timed(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timings[phase] = self.timings.get(phase, 0.0) + time.perf_counter() - start

    def home(self, *parts: str) -> Path:
        return Artifacts(self.registry.root).target_home(self.new.fingerprint) / Path(*parts)

    # -- step 1: who is new, who is old
    def resolve_targets(self) -> None:
        self.new = TargetInfo.from_dir(self.opts.target_path)
        self.record["new_target"] = asdict(self.new)
        self.record_path = self.opts.record_path or self.home("hook", f"decision-{self.stamp}.json")
        self.baseline = self._baseline()
        self.record["baseline"] = asdict(self.baseline)

    def _baseline(self) -> TargetInfo:
        reg, wanted = self.registry, self.opts.baseline
        if wanted:
            if Path(wanted).is_dir():
                info = TargetInfo.from_dir(wanted)
            elif reg.read(wanted) is not None:
                info = reg.read(wanted).target
            else:
                raise HookError(f"baseline={wanted}: no such target directory, and no target with that fingerprint "
                                f"in registry {reg.root}")
            if not reg.promoted(info.fingerprint) and info.fingerprint != self.new.fingerprint:
                raise HookError(f"baseline {wanted} (fingerprint {info.fingerprint}) has no promoted drafts in registry "
                                f"{reg.root}; register them with `draftsmith drafts add ... --status promoted`")
            return info
        others = [fp for fp in reg.fingerprints() if fp != self.new.fingerprint and reg.promoted(fp)]
        if not others:
            raise HookError(f"no baseline: registry {reg.root} has no promoted drafts for another target; "
                            f"pass baseline=OLD_TARGET_DIR")
        latest = max(others, key=lambda fp: max(e.updated_at for e in reg.promoted(fp)))
        return reg.read(latest).target

    # -- step 2/3: decide per old draft
    def assess(self) -> None:
        old_entries = self.registry.promoted(self.baseline.fingerprint)
        incompatible = rules.vocab_change(asdict(self.baseline), asdict(self.new))
        self.record["vocab_change"] = incompatible
        for entry in old_entries:
            outcome = DraftOutcome(entry.id, entry.kind, entry.path)
            self.outcomes.append(outcome)
            missing = entry.missing_files()
            if any(not m.startswith("report") for m in missing):
                self._fail(outcome, f"registry entry {entry.id}: its files are gone ({'; '.join(missing)})")
            elif incompatible:
                scratch = self.opts.policy.from_scratch_on_vocab_change
                outcome.action = "retrain" if scratch else "incompatible"
                outcome.reason = (f"new target changes the vocabulary ({incompatible}): drafts cannot be reused"
                                  + ("; retraining from scratch" if scratch else "; set hook.from_scratch=true to "
                                     "retrain from scratch"))
                if not scratch:
                    self.errors.append(f"{entry.id}: {outcome.reason}")
                self._reference_only(entry, outcome)
            else:
                self._assess_one(entry, outcome)

    def _fail(self, outcome: DraftOutcome, message: str) -> None:
        outcome.action, outcome.reason = "error", message
        self.errors.append(message)

    def _reference(self, entry: DraftEntry) -> tuple[list, str] | None:
        """Rows of the draft's last report on the old target and its method label there."""
        if entry.report_path and Path(entry.report_path).is_file():
            try:
                return load_report(entry.report_path).results, entry.report_method or entry.kind
            except ReportSchemaError:
                pass  # fall through: re-measure on the old target when it is still around
        old_dir = self.baseline.path
        if old_dir and Path(old_dir).is_dir():
            with self.timed("evaluate_reference"):
                report = self.collab.evaluator.evaluate(Path(old_dir), {entry.kind: Path(entry.path)},
                                                        self.opts.domains or [], self.opts.profile)
            return report.results, entry.kind
        return None

    def _reference_only(self, entry: DraftEntry, outcome: DraftOutcome) -> None:
        ref = self._reference(entry)
        alphas = rules.domain_alphas(*ref) if ref is not None else {}
        for d in self.opts.domains or sorted(alphas):
            outcome.domains[d] = {"old_target": alphas.get(d), "new_target": None, "drop": None, "candidate": None}

    def _cannot_run(self, outcome: DraftOutcome, ref: tuple[list, str], reason: str) -> None:
        """Retrain from scratch (init_from stays None: the old weights do not fit) on every domain."""
        outcome.action, outcome.reason = "retrain", reason
        alphas = rules.domain_alphas(*ref)
        for d in self.opts.domains or sorted(alphas):
            outcome.domains[d] = {"old_target": alphas.get(d), "new_target": None, "drop": None, "candidate": None}

    def _assess_one(self, entry: DraftEntry, outcome: DraftOutcome) -> None:
        ref = self._reference(entry)
        if ref is None:
            return self._fail(outcome, f"{entry.id}: no usable last report ({entry.report_path}) and the baseline "
                                       f"target dir is unknown or gone, so there is nothing to compare against")
        ref_rows, ref_method = ref
        if not rules.domain_alphas(ref_rows, ref_method):
            return self._fail(outcome, f"{entry.id}: its last report ({entry.report_path}) has no alpha for method "
                                       f"{ref_method!r}; set the entry's report_method or re-evaluate it")
        domains = self.opts.domains or sorted(rules.domain_alphas(ref_rows, ref_method))
        try:
            self.collab.loader.check(Path(entry.path), self.opts.target_path)
        except ValueError as err:
            return self._cannot_run(outcome, ref, f"no longer loads on the new target: {err}")
        with self.timed("evaluate_old_drafts"):
            report = self.collab.evaluator.evaluate(self.opts.target_path, {entry.kind: Path(entry.path)},
                                                    domains, self.opts.profile)
        outcome.report_new_target = str(self._save_report(report, f"{entry.kind}-old-draft"))
        points = rules.operating_points(report.results, entry.kind)
        if not points:
            skips = [f"{s.domain}: {s.reason}" for s in report.skipped if s.method == entry.kind]
            return self._cannot_run(outcome, ref, "the eval could not run it on the new target"
                                    + (f" ({'; '.join(skips)})" if skips else ""))
        reference = rules.domain_alphas(ref_rows, ref_method, points) or rules.domain_alphas(ref_rows, ref_method)
        current = rules.domain_alphas(report.results, entry.kind, points)
        changes = rules.compare_domains(reference, current, domains)
        outcome.domains = {d: {"old_target": c.before, "new_target": c.after, "drop": c.drop, "candidate": None}
                           for d, c in changes.items()}
        outcome.regressed = rules.regressed_domains(changes, self.opts.policy.regression_threshold)
        if outcome.regressed:
            outcome.action, outcome.init_from = "retrain", entry.path
            outcome.reason = (f"alpha fell by more than {self.opts.policy.regression_threshold:g} on "
                              f"{', '.join(outcome.regressed)}")
        else:
            outcome.reason = f"no domain fell by more than {self.opts.policy.regression_threshold:g}"

    def _save_report(self, report: Report, label: str) -> Path:
        return write_report(report, self.home("reports", f"hook-{self.stamp}-{label}"), plots=False).json

    # -- step 4: act
    def act(self) -> None:
        retrain = [o for o in self.outcomes if o.action == "retrain"]
        entries = {e.id: e for e in self.registry.promoted(self.baseline.fingerprint)}
        if retrain:
            from_scratch = any(o.init_from is None for o in retrain)
            domains = sorted({d for o in retrain for d in o.domains})
            regressed = sorted({d for o in retrain for d in o.regressed})
            scope = "all" if from_scratch else self.opts.policy.scope
            plan = rules.data_plan(domains, regressed, scope, self.opts.policy.replay_share)
            self.record["data"] = {"plan": plan, "scope": scope, "path": None}
            if self.opts.dry_run:
                return
            with self.timed("regenerate"):
                data = self.collab.regenerator.regenerate(self.opts.target_path, plan, self.home("data", f"hook-{self.stamp}"))
            self.record["data"]["path"] = str(data)
            for outcome in retrain:
                self._retrain(outcome, entries[outcome.id], data)
        if not self.opts.dry_run:
            self._carry_over(entries)

    def _retrain(self, outcome: DraftOutcome, old: DraftEntry, data: Path) -> None:
        with self.timed("distill"):
            draft_dir = self.collab.distiller.distill(
                old.kind, self.opts.target_path, data, Path(outcome.init_from) if outcome.init_from else None,
                out_dir=self.home("drafts", f"{old.kind}-hook-{self.stamp}"), parent_run=old.extra.get("wandb_run"))
        cand = self.registry.add(draft_dir, self.new, parent_id=old.id, note=f"hook {self.stamp}: {outcome.reason}",
                                 extra={"hook_record": str(self.record_path)})
        with self.timed("evaluate_candidates"):
            report = self.collab.evaluator.evaluate(self.opts.target_path, {old.kind: Path(draft_dir)},
                                                    sorted(outcome.domains), self.opts.profile)
        report_path = self._save_report(report, f"{old.kind}-candidate")
        self.registry.update(cand.id, report_path=str(report_path), report_method=old.kind)
        alphas = rules.domain_alphas(report.results, old.kind)
        threshold = self.opts.policy.regression_threshold
        bar: dict[str, float | None] = {}
        for d, row in outcome.domains.items():
            row["candidate"] = alphas.get(d)
            if row["new_target"] is not None:
                bar[d] = row["new_target"]
            elif row["old_target"] is not None:  # the old draft cannot run here: hold it to its old level
                bar[d] = max(0.0, row["old_target"] - threshold)
        check = rules.promotion_check(bar, alphas, self.opts.policy.promote_tolerance)
        if check.promote:
            self.registry.promote(cand.id)
        outcome.candidate = {"id": cand.id, "path": str(draft_dir), "report": str(report_path),
                             "promoted": check.promote, "reason": check.reason, "bar": bar}

    def _carry_over(self, entries: dict[str, DraftEntry]) -> None:
        """An old draft that still runs keeps serving the new target unless a promoted candidate replaced it."""
        if self.new.fingerprint == self.baseline.fingerprint:
            return
        for o in self.outcomes:
            replaced = bool(o.candidate and o.candidate["promoted"])
            if o.report_new_target is None or replaced or o.action in ("error", "incompatible"):
                continue
            if any(Path(e.path) == Path(o.path) for e in self.registry.entries(self.new.fingerprint)):
                continue
            carried = self.registry.add(o.path, self.new, report_path=o.report_new_target, report_method=o.kind,
                                        status="promoted", parent_id=o.id, note=f"carried over by hook {self.stamp}")
            o.candidate = (o.candidate or {}) | {"carried_over_as": carried.id}

    # -- step 5: record
    def finish(self, started: float) -> int:
        retrained = [o for o in self.outcomes if o.candidate and "id" in o.candidate]
        promoted = [o for o in retrained if o.candidate["promoted"]]
        code = rules.exit_code(self.errors, len(retrained), len(promoted))
        if self.opts.dry_run and code != rules.EXIT_ERROR:
            code = rules.EXIT_OK
        needed = any(o.action == "retrain" for o in self.outcomes)
        outcome = ("error" if code == rules.EXIT_ERROR else "dry_run" if self.opts.dry_run
                   else "not_promoted" if code == rules.EXIT_NOT_PROMOTED else "promoted" if retrained
                   else "nothing_needed")
        self.timings["total"] = time.perf_counter() - started
        self.record.update(drafts=[asdict(o) for o in self.outcomes], retrain_needed=needed, errors=self.errors,
                           outcome=outcome, exit_code=code, timings_s={k: round(v, 3) for k, v in self.timings.items()})
        return code


def run_hook(opts: HookOptions, collab: Collaborators, registry: Registry | None = None) -> tuple[int, dict, Path | None]:
    """Run the hook; returns (exit code, decision record, record path). Never raises for bad input."""
    started = time.perf_counter()
    registry = registry or Registry(opts.registry_root, opts.lock_timeout_s)
    run = _Run(opts, collab, registry)
    try:
        run.resolve_targets()
        lock = contextlib.nullcontext() if opts.dry_run else registry.locked(opts.lock_timeout_s)
        with lock:
            if run.new.fingerprint == run.baseline.fingerprint:
                run.record["note"] = "the new target has the baseline's fingerprint: nothing changed"
            else:
                run.assess()
                if not any(o.action == "error" for o in run.outcomes) and not (
                        run.record.get("vocab_change") and not opts.policy.from_scratch_on_vocab_change):
                    run.act()
    except (ValueError, RegistryLockedError) as err:  # bad input, a state we cannot act on: the message says it
        run.errors.append(str(err))
    except Exception as err:  # a failed job (eval, generate, distill): still exit 2 with a record, and the stack
        traceback.print_exc()
        run.errors.append(f"{type(err).__name__}: {err}")
    code = run.finish(started)
    if run.record_path is not None:  # None only when the new target itself could not be read
        atomic_write_text(Path(run.record_path), json.dumps(run.record, indent=2, default=str) + "\n")
    return code, run.record, run.record_path


# ----------------------------------------------------------------------------- CLI

_HOOK_KEYS = {"hook.threshold": "regression_threshold", "hook.tolerance": "promote_tolerance",
              "hook.scope": "scope", "hook.replay_share": "replay_share",
              "hook.from_scratch": "from_scratch_on_vocab_change"}
_COLLABORATOR_KEYS = ("hook.evaluator", "hook.regenerator", "hook.distiller", "hook.loader")


def _bool(key: str, value: str) -> bool:
    if value.lower() in ("true", "1", "yes"):
        return True
    if value.lower() in ("false", "0", "no"):
        return False
    raise HookError(f"{key}: expected true or false, got {value!r}")


def parse_args(argv: list[str]) -> tuple[HookOptions, dict[str, str], list[str]]:
    """(options, collaborator specs, pass-through overrides for the real collaborators)."""
    pairs, rest = split_key_values(argv)
    p = argparse.ArgumentParser(prog="draftsmith hook", description=__doc__.split("\n\n")[0])
    p.add_argument("event", choices=["target-updated"])
    p.add_argument("--dry-run", action="store_true", help="report the decision; train and change nothing")
    args = p.parse_args(rest)
    if not pairs.get("target.path"):
        raise HookError("target.path=NEW_TARGET_DIR is required")
    policy_kw: dict[str, Any] = {}
    for key, name in _HOOK_KEYS.items():
        if key in pairs:
            value = pairs.pop(key)
            try:
                policy_kw[name] = (_bool(key, value) if name == "from_scratch_on_vocab_change"
                                   else value if name == "scope" else float(value))
            except ValueError as err:
                raise HookError(f"{key}: {err}") from None
    domains = pairs.pop("hook.domains", None)
    opts = HookOptions(
        target_path=Path(pairs.pop("target.path")).expanduser(),
        registry_root=registry_root(pairs),
        baseline=pairs.pop("baseline", None),
        policy=rules.HookPolicy(**policy_kw),
        profile=pairs.pop("hook.profile", "quick"),
        domains=[d.strip() for d in domains.strip("[]").split(",") if d.strip()] if domains else None,
        lock_timeout_s=float(pairs.pop("lock_timeout", DEFAULT_LOCK_TIMEOUT_S)),
        dry_run=args.dry_run or _bool("dry_run", pairs.pop("dry_run", "false")),
        record_path=Path(pairs.pop("hook.record")) if "hook.record" in pairs else None,
    )
    pairs.pop("registry", None)
    specs = {key.split(".", 1)[1]: pairs.pop(key) for key in _COLLABORATOR_KEYS if key in pairs}
    unknown = sorted(k for k in pairs if k.startswith("hook."))
    if unknown:
        raise HookError(f"unknown hook option(s) {', '.join(unknown)}; known: "
                        f"{', '.join(sorted([*_HOOK_KEYS, *_COLLABORATOR_KEYS, 'hook.profile', 'hook.domains', 'hook.record']))}")
    overrides = [f"{k}={v}" for k, v in pairs.items()]  # e.g. artifacts_root=, train.max_steps=: for the real jobs
    return opts, specs, overrides


def print_summary(record: dict, record_path: Path | None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    drafts = record.get("drafts", [])
    table = Table(title=f"draftsmith hook: {record.get('outcome')} (exit {record.get('exit_code')})")
    for col in ("draft", "domain", "old draft, old target", "old draft, new target", "candidate, new target", "action"):
        table.add_column(col, no_wrap=col in ("draft", "domain"))
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    for d in drafts:
        promoted = (d.get("candidate") or {}).get("promoted")
        action = d["action"] + ("" if promoted is None else " -> promoted" if promoted else " -> not promoted")
        for domain, row in sorted(d["domains"].items()) or [("-", {})]:
            flag = " *" if domain in d["regressed"] else ""
            table.add_row(d["kind"], domain + flag, fmt(row.get("old_target")), fmt(row.get("new_target")),
                          fmt(row.get("candidate")), action)
    console.print(table if drafts else f"draftsmith hook: {record.get('outcome')} (exit {record.get('exit_code')})")
    if any(d["regressed"] for d in drafts):
        console.print(f"* regressed: alpha fell by more than {record['policy']['regression_threshold']:g}")
    for d in drafts:
        console.print(f"{d['id']}: {d['reason']}", soft_wrap=True, markup=False)
    for err in record.get("errors", []):
        console.print(f"error: {err}", style="red", soft_wrap=True, markup=False)
    console.print(f"decision record: {record_path}  wall time {record['timings_s'].get('total', 0):.1f} s",
                  soft_wrap=True, markup=False)


def main(argv: list[str] | None = None, collaborators: Collaborators | None = None) -> int:
    """Exit status 0 / 3 / 2 (see module doc). Called without argv (the dispatcher) it exits with it."""
    if argv is None:
        raise SystemExit(main(sys.argv[1:], collaborators))
    try:
        opts, specs, overrides = parse_args(argv)
    except ValueError as err:
        print(f"draftsmith hook: error: {err}", file=sys.stderr)
        return rules.EXIT_ERROR
    collab = collaborators or Collaborators.real(specs, overrides)
    code, record, record_path = run_hook(opts, collab)
    print_summary(record, record_path)
    return code


if __name__ == "__main__":
    sys.exit(main())
