"""The hook's heavy collaborators (eval harness, data generation, distillation, draft loading) behind
small protocols, so the decision logic is tested with scripted fakes. The real ones are named
'module:function' (``hook.evaluator=...`` etc. replace them) and imported at their first call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from draftsmith.serve_eval.eval.report import Report
from draftsmith.train.hook.decision import HookError
from draftsmith.train.named import resolve
from draftsmith.train.registry.lineage import Lineage, NoLineage
from draftsmith.train.registry.records import ArtifactRef, RegisteredTarget


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


# train.hook.jobs adapts generate/distill (which choose their own cache dirs) to these keyword calls;
# the harness's evaluate loads old drafts with strict_fingerprint=False all the way to the proposers.
DEFAULT_SPECS = {"evaluator": "draftsmith.serve_eval.eval.harness:evaluate",
                 "regenerator": "draftsmith.train.hook.jobs:regenerate",
                 "distiller": "draftsmith.train.hook.jobs:distill"}


class _Named:
    """A collaborator function named 'module:function', imported at its first call."""

    def __init__(self, role: str, spec: str, overrides: list[str]):
        self.role, self.spec, self.overrides = role, spec, overrides

    def __call__(self, **kwargs: Any) -> Any:
        try:
            fn = resolve(self.spec, f"hook {self.role}")
        except ValueError as err:
            raise HookError(str(err)) from None
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
    """draftsmith.drafts.io.load_draft against the target's sizes (not its fingerprint: it changed, that is the point)."""

    def check(self, draft_dir: Path, target_dir: Path) -> None:
        from draftsmith.drafts.io import ExpectedTarget, load_draft

        loaded = load_draft(draft_dir, ExpectedTarget.from_config(target_dir, None))
        aux = getattr(loaded.model.config, "aux_layers", None)
        num_layers = json.loads((Path(target_dir) / "config.json").read_text()).get("num_hidden_layers")
        if aux and num_layers is not None and max(aux) > num_layers:
            raise ValueError(f"{draft_dir}: eagle3 draft reads target hidden states {aux}, but the target has only "
                             f"{num_layers} layers")


class ConfiguredLineage:
    """W&B lineage with the jobs' own settings (``wandb.*`` and ``artifacts_root`` among the pass-through
    overrides, the config's defaults otherwise: offline); built at its first call."""

    _KEYS = ("artifacts_root", "wandb.mode", "wandb.project", "wandb.entity")

    def __init__(self, overrides: list[str]):
        self.overrides = [o for o in overrides if o.partition("=")[0].lstrip("+~") in self._KEYS]
        self._inner: Lineage | None = None

    def log_chain(self, target: RegisteredTarget, data_dir: Path, draft_dir: Path, report_path: Path,
                  parents: list[ArtifactRef] | tuple = ()) -> list[ArtifactRef]:
        return self._lineage().log_chain(target, data_dir, draft_dir, report_path, parents)

    def log_pipeline_run(self, target: RegisteredTarget, data_dir: Path, drafts: dict[str, Path],
                         report_path: Path) -> dict[str, list[ArtifactRef]]:
        return self._lineage().log_pipeline_run(target, data_dir, drafts, report_path)

    def _lineage(self) -> Lineage:
        if self._inner is None:
            from draftsmith.drafts.artifacts import Artifacts
            from draftsmith.train.config import compose
            from draftsmith.train.logs import WandbSettings
            from draftsmith.train.registry.lineage import lineage_for

            cfg = compose(self.overrides)
            self._inner = lineage_for(WandbSettings.from_config(cfg), Artifacts(Path(cfg.artifacts_root)).wandb_dir)
        return self._inner


@dataclass
class Collaborators:
    evaluator: Evaluator
    regenerator: Regenerator
    distiller: Distiller
    loader: DraftLoader = field(default_factory=DraftIOLoader)
    lineage: Lineage = field(default_factory=NoLineage)   # the fakes log nothing; real() logs to W&B

    @classmethod
    def real(cls, specs: dict[str, str] | None = None, overrides: list[str] | None = None) -> "Collaborators":
        """The real jobs by name (``hook.evaluator=module:function`` etc. replace them); overrides reach each."""
        specs, overrides = {**DEFAULT_SPECS, **(specs or {})}, list(overrides or [])
        loader = DraftIOLoader()
        if "loader" in specs:
            try:
                loader = resolve(specs["loader"], "hook loader")()
            except ValueError as err:
                raise HookError(str(err)) from None
        return cls(NamedEvaluator("evaluator", specs["evaluator"], overrides),
                   NamedRegenerator("regenerator", specs["regenerator"], overrides),
                   NamedDistiller("distiller", specs["distiller"], overrides), loader, ConfiguredLineage(overrides))
