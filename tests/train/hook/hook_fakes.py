"""Scripted collaborators of the retrain hook, shared by its tests (the `world` fixture is in conftest.py).

Every fake draft dir carries ``alphas.json`` = {target dir name: {domain: alpha}}, which the fake evaluator
reports as measured.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from draftsmith.serve_eval.eval.report import Report, ResultRow, SkippedEntry
from draftsmith.serve_eval.eval.report import TargetInfo as ReportTarget
from draftsmith.serve_eval.eval.report_files import write_report
from draftsmith.train.hook.cli import run_hook
from draftsmith.train.hook.collaborators import Collaborators
from draftsmith.train.hook.state import HookOptions
from draftsmith.train.registry.records import RegisteredTarget
from draftsmith.train.registry.store import Registry

DOMAINS = ["chat", "code", "math", "prose"]
OLD = {"chat": 0.70, "code": 0.75, "math": 0.68, "prose": 0.72}


def row(domain: str, method: str, alpha: float | None, K: int = 4, T: float = 0.0) -> ResultRow:
    return ResultRow(domain, method, K, T, alpha, None if alpha is None else 1 + K * alpha, [], 10.0, 100.0,
                     None, None, None, None, None, None, None, None, 1, 0.0)


def make_target(path: Path, weight: float, vocab: int = 128, tokenizer: str = "base") -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"vocab_size": vocab, "hidden_size": 64, "num_hidden_layers": 2}))
    save_file({"w": torch.full((4,), weight)}, str(path / "model.safetensors"))
    (path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {tokenizer: 0}}, "added_tokens": []}))
    return path


def make_draft(path: Path, alphas: dict[str, dict[str, float]], kind: str = "eagle3") -> Path:
    path.mkdir(parents=True)
    (path / "draftsmith.json").write_text(json.dumps({"kind": kind, "target_fingerprint": None,
                                                      "metrics": {"wandb_run": f"run-{path.name}"}}))
    (path / "config.json").write_text(json.dumps({"draftsmith_kind": kind}))
    (path / "alphas.json").write_text(json.dumps(alphas))
    return path


class FakeEvaluator:
    def __init__(self):
        self.calls: list[tuple[str, dict, list, str]] = []

    def evaluate(self, target_dir, drafts, domains, profile):
        self.calls.append((Path(target_dir).name, dict(drafts), list(domains), profile))
        rows, skipped = [], []
        for label, draft in drafts.items():
            measured = json.loads((Path(draft) / "alphas.json").read_text()).get(Path(target_dir).name)
            if measured is None:  # scripted: this draft cannot run on this target
                skipped += [SkippedEntry(d, label, "aux layer 7 out of range") for d in domains]
                continue
            rows += [row(d, label, measured[d]) for d in (domains or sorted(measured))]
        return Report(ReportTarget(str(target_dir), "fp"), {"profile": profile}, rows, skipped)


class FakeRegenerator:
    def __init__(self):
        self.plans: list[dict] = []

    def regenerate(self, target_dir, plan, out_dir):
        self.plans.append(dict(plan))
        out_dir.mkdir(parents=True)
        return out_dir


class FakeDistiller:
    """Produces a candidate whose measured alphas are scripted per run."""

    def __init__(self, candidate_alphas: dict[str, dict[str, float]]):
        self.candidate_alphas = candidate_alphas
        self.calls: list[dict] = []

    def distill(self, kind, target_dir, data, init_from, *, out_dir, parent_run=None):
        self.calls.append({"kind": kind, "target": Path(target_dir).name, "data": data, "init_from": init_from,
                           "parent_run": parent_run})
        return make_draft(out_dir, self.candidate_alphas, kind)


class FakeLoader:
    def __init__(self, broken: set[str] = frozenset()):
        self.broken = broken

    def check(self, draft_dir, target_dir):
        if Path(draft_dir).name in self.broken:
            raise ValueError(f"{draft_dir}: eagle3 draft was built for target hidden_size=64, but the target has 96")


def make_world(tmp_path: Path):
    """Old and new target, an old draft promoted for the old target with its eval report, a registry."""
    old_t, new_t = make_target(tmp_path / "old", 0.0), make_target(tmp_path / "new", 1.0)
    registry = Registry(tmp_path / "registry", lock_timeout_s=5)

    def install(new_alphas: dict[str, float], name: str = "old-draft") -> Path:
        draft = make_draft(tmp_path / name, {"old": OLD, "new": new_alphas})
        report = FakeEvaluator().evaluate(old_t, {"eagle3": draft}, DOMAINS, "full")
        files = write_report(report, tmp_path / f"{name}-report", plots=False)
        registry.add(draft, RegisteredTarget.from_dir(old_t), report_path=files.json, status="promoted")
        return draft

    return type("World", (), {"old": old_t, "new": new_t, "registry": registry, "install": staticmethod(install),
                              "tmp": tmp_path})


def hook(world, distiller=None, loader=None, **opts):
    evaluator, regen = FakeEvaluator(), FakeRegenerator()
    distiller = distiller or FakeDistiller({})
    collab = Collaborators(evaluator, regen, distiller, loader or FakeLoader())
    options = HookOptions(target_path=world.new, registry_root=world.registry.root, **opts)
    code, record, path = run_hook(options, collab)
    return code, record, path, evaluator, regen, distiller


NEW_CODE_DROP = {"chat": 0.69, "code": 0.52, "math": 0.67, "prose": 0.72}


class CurveDistiller(FakeDistiller):
    """Each round's candidate reaches the next point of a scripted curve (on the new target)."""

    def __init__(self, curve: list[dict[str, float]]):
        super().__init__({})
        self.curve = curve

    def distill(self, kind, target_dir, data, init_from, *, out_dir, parent_run=None):
        self.candidate_alphas = {"new": self.curve[min(len(self.calls), len(self.curve) - 1)]}
        return super().distill(kind, target_dir, data, init_from, out_dir=out_dir, parent_run=parent_run)
