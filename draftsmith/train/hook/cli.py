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
logic is tested with scripted fakes; the rules themselves live in ``draftsmith.train.hook.decision``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from draftsmith.drafts.files import atomic_write_text
from draftsmith.train.hook import decision as rules
from draftsmith.train.hook.act import act, finish
from draftsmith.train.hook.assess import assess, resolve_targets
from draftsmith.train.hook.collaborators import Collaborators
from draftsmith.train.hook.decision import HookError
from draftsmith.train.hook.state import DEFAULT_PROFILE, DriftTrigger, HookOptions, HookRun
from draftsmith.train.registry.cli import registry_root, split_key_values
from draftsmith.train.registry.store import DEFAULT_LOCK_TIMEOUT_S, Registry, RegistryLockedError


def run_hook(opts: HookOptions, collab: Collaborators, registry: Registry | None = None) -> tuple[int, dict, Path | None]:
    """Run the hook; returns (exit code, decision record, record path). Never raises for bad input."""
    started = time.perf_counter()
    registry = registry or Registry(opts.registry_root, opts.lock_timeout_s)
    run = HookRun(opts, collab, registry)
    try:
        resolve_targets(run)
        lock = contextlib.nullcontext() if opts.dry_run else registry.locked(opts.lock_timeout_s)
        with lock:
            if run.new.fingerprint == run.baseline.fingerprint and opts.drift is None:
                run.record["note"] = "the new target has the baseline's fingerprint: nothing changed"
            else:
                assess(run)
                if not any(o.action == "error" for o in run.outcomes) and not (
                        run.record.get("vocab_change") and not opts.policy.from_scratch_on_vocab_change):
                    act(run)
    except (ValueError, RegistryLockedError) as err:  # bad input, a state we cannot act on: the message says it
        run.errors.append(str(err))
    except Exception as err:  # a failed job (eval, generate, distill): still exit 2 with a record, and the stack
        traceback.print_exc()
        run.errors.append(f"{type(err).__name__}: {err}")
    code = finish(run, started)
    if run.record_path is not None:  # None only when the new target itself could not be read
        atomic_write_text(Path(run.record_path), json.dumps(run.record, indent=2, default=str) + "\n")
    return code, run.record, run.record_path


_HOOK_KEYS = {"hook.threshold": "regression_threshold", "hook.tolerance": "promote_tolerance",
              "hook.scope": "scope", "hook.replay_share": "replay_share",
              "hook.from_scratch": "from_scratch_on_vocab_change", "hook.max_rounds": "max_rounds",
              "hook.recovery_tolerance": "recovery_tolerance", "hook.recovery_share": "recovery_share",
              "hook.plateau_gain": "plateau_gain"}
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
    p.add_argument("event", choices=["target-updated", "drift"])
    p.add_argument("event_file", nargs="?", help="drift: the server's drift event (its JSON-lines log; the "
                                                   "last event is taken)")
    p.add_argument("--dry-run", action="store_true", help="report the decision; train and change nothing")
    args = p.parse_args(rest)
    drift = _drift_trigger(args, pairs)
    if not pairs.get("target.path"):
        raise HookError("target.path=NEW_TARGET_DIR is required")
    policy_kw: dict[str, Any] = {}
    for key, name in _HOOK_KEYS.items():
        if key in pairs:
            value = pairs.pop(key)
            try:
                policy_kw[name] = (_bool(key, value) if name == "from_scratch_on_vocab_change"
                                   else value if name == "scope" else int(value) if name == "max_rounds"
                                   else float(value))
            except ValueError as err:
                raise HookError(f"{key}: {err}") from None
    domains = pairs.pop("hook.domains", None)
    opts = HookOptions(
        target_path=Path(pairs.pop("target.path")).expanduser(),
        registry_root=registry_root(pairs),
        baseline=pairs.pop("baseline", None),
        policy=rules.HookPolicy(**policy_kw),
        profile=pairs.pop("hook.profile", DEFAULT_PROFILE),
        domains=[d.strip() for d in domains.strip("[]").split(",") if d.strip()] if domains else None,
        lock_timeout_s=float(pairs.pop("lock_timeout", DEFAULT_LOCK_TIMEOUT_S)),
        dry_run=args.dry_run or _bool("dry_run", pairs.pop("dry_run", "false")),
        record_path=Path(pairs.pop("hook.record")) if "hook.record" in pairs else None,
        drift=drift,
    )
    pairs.pop("registry", None)
    specs = {key.split(".", 1)[1]: pairs.pop(key) for key in _COLLABORATOR_KEYS if key in pairs}
    unknown = sorted(k for k in pairs if k.startswith("hook."))
    if unknown:
        raise HookError(f"unknown hook option(s) {', '.join(unknown)}; known: "
                        f"{', '.join(sorted([*_HOOK_KEYS, *_COLLABORATOR_KEYS, 'hook.profile', 'hook.domains', 'hook.record']))}")
    overrides = [f"{k}={v}" for k, v in pairs.items()]  # e.g. artifacts_root=, train.max_steps=: for the real jobs
    return opts, specs, overrides


def _drift_trigger(args: argparse.Namespace, pairs: dict[str, str]) -> DriftTrigger | None:
    """`hook drift EVENT`: the slice to re-distill; the event's target is the target and the baseline."""
    if args.event != "drift":
        if args.event_file:
            raise HookError(f"{args.event}: takes no event file (only `hook drift EVENT` does)")
        return None
    if not args.event_file:
        raise HookError("drift: pass the drift event file, e.g. `draftsmith hook drift drift-events.jsonl`")
    from draftsmith.serve_eval.server.drift import DriftEvent
    event = DriftEvent.from_file(args.event_file)
    if not pairs.get("target.path"):
        if not event.target:
            raise HookError(f"{args.event_file}: the event names no target; pass target.path=DIR")
        pairs["target.path"] = event.target
    pairs.setdefault("baseline", pairs["target.path"])
    return DriftTrigger(event.domain, event.method, f"served alpha {event.rolling_alpha:.3f} on {event.domain} "
                        f"fell below its bar {event.bar:.3f} (eval reference {event.reference_alpha:.3f})")


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
