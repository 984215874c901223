"""What one hook invocation holds: its options, each old draft's outcome, and the shared state that
the steps (`assess`, then `act`) read and fill, ending in the decision record."""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from draftsmith.drafts.artifacts import Artifacts
from draftsmith.serve_eval.eval.report import Report
from draftsmith.serve_eval.eval.report_files import write_report
from draftsmith.train.hook import decision as rules
from draftsmith.train.hook.collaborators import Collaborators
from draftsmith.train.registry.records import RegisteredTarget, utc_now
from draftsmith.train.registry.store import DEFAULT_LOCK_TIMEOUT_S, Registry

RECORD_SCHEMA_VERSION = 1
# The hook decides on alpha alone, so its evals skip the plain-decoding baseline (conf/eval/acceptance.yaml).
DEFAULT_PROFILE = "acceptance"


@dataclass(frozen=True)
class DriftTrigger:
    """A serving drift event (`draftsmith hook drift EVENT`): re-distill `kind` on `domain` even though
    the target did not change, because the served acceptance there fell below its bar."""
    domain: str
    kind: str | None          # the served draft's kind (None: every promoted draft)
    reason: str


@dataclass
class HookOptions:
    target_path: Path
    registry_root: Path
    baseline: str | None = None
    policy: rules.HookPolicy = field(default_factory=rules.HookPolicy)
    profile: str = DEFAULT_PROFILE      # eval profile passed to the evaluator
    domains: list[str] | None = None    # None: the domains of each draft's last report
    lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S
    dry_run: bool = False
    record_path: Path | None = None     # None: <registry>/targets/<new fp>/hook/decision-<stamp>.json
    drift: DriftTrigger | None = None   # set by `hook drift`: the slice to re-distill on the same target


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


class HookRun:
    """One hook invocation: the state the steps share, and the record they fill."""

    new: RegisteredTarget        # set by assess.resolve_targets
    baseline: RegisteredTarget

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

    def save_report(self, report: Report, label: str) -> Path:
        return write_report(report, self.home("reports", f"hook-{self.stamp}-{label}"), plots=False).json
