"""The pipeline's ``register`` stage logs each draft's lineage (target -> data -> draft -> report) to W&B
(offline) in a fixed number of runs and keeps the refs in the registry entries; a cached rerun logs
nothing, a W&B failure costs the lineage and not the registration, and W&B disabled logs nothing.

A focused context (a tiny target checkpoint, two draft dirs, a dataset dir and a report), not the
smoke pipeline: that one trains every draft and runs with W&B disabled."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from draftsmith.drafts.artifacts import Artifacts
from test_registry import make_draft
from draftsmith.train.config import compose
from draftsmith.train.logs import init_wandb
from draftsmith.train.pipeline.context import PipelineContext
from draftsmith.train.pipeline.evaluate import stage_register
from draftsmith.train.registry.cli import main as registry_main
from draftsmith.train.registry.lineage import logged_chain
from draftsmith.train.registry.records import RegisteredTarget
from draftsmith.train.registry.store import Registry
from draftsmith.train.target import TargetResult

pytest.importorskip("wandb")

KINDS = ("standalone", "eagle")


def register_context(tmp_path: Path, mode: str = "offline") -> PipelineContext:
    """What ``register`` reads from the earlier stages, with the config's W&B in ``mode``."""
    model_dir = tmp_path / "target"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"vocab_size": 16, "hidden_size": 8, "num_hidden_layers": 1}))
    save_file({"w": torch.zeros(2, 2)}, str(model_dir / "model.safetensors"))
    fingerprint = RegisteredTarget.from_dir(model_dir).fingerprint
    artifacts = Artifacts(tmp_path / "artifacts")
    dataset = artifacts.data_dir(fingerprint) / "pipeline-1"
    dataset.mkdir()
    (dataset / "manifest.json").write_text(json.dumps({"records": 2}))
    eval_dir = artifacts.reports_dir(fingerprint) / "20261201T000000-pipeline-k1"
    eval_dir.mkdir()
    (eval_dir / "report.json").write_text(json.dumps({"results": []}))
    cfg = compose(["pipeline=smoke", f"artifacts_root={artifacts.root}", f"wandb.mode={mode}",
                   "wandb.project=register-lineage-test"])
    ctx = PipelineContext(cfg, artifacts, run=None)
    ctx.results.target = TargetResult(model_dir, fingerprint, {}, cached=True)
    ctx.results.dataset = dataset
    ctx.results.eval_dir = eval_dir
    for kind in KINDS:
        draft = make_draft(artifacts.drafts_dir(fingerprint) / f"{kind}-k1", kind=kind, fingerprint=fingerprint)
        (draft / "model.safetensors").write_bytes(kind.encode())
        ctx.results.drafts[kind] = draft
    return ctx


def run_dirs(ctx: PipelineContext) -> list[Path]:
    return sorted(p for p in ctx.artifacts.wandb_dir.rglob("offline-run-*") if p.is_dir())


def entries(ctx: PipelineContext) -> dict[str, object]:
    return {e.kind: e for e in Registry(ctx.artifacts.root).entries(ctx.results.target.fingerprint)}


def test_register_logs_each_drafts_lineage_once_and_a_rerun_logs_nothing(tmp_path, capsys):
    ctx = register_context(tmp_path)
    ctx.run = init_wandb(ctx.cfg, job_type="pipeline", wandb_dir=ctx.artifacts.wandb_dir)   # open, as in the job
    pipeline_run = Path(ctx.run.dir).parent
    fields = stage_register(ctx)
    ctx.run.log({"after_register": 1})                           # the job's own run is still open
    ctx.run.finish()
    assert fields["lineage"] == "logged" and fields["lineage_drafts"] == ",".join(KINDS), fields
    assert all(fields[kind] == "added" for kind in KINDS)
    lineage_runs = [p for p in run_dirs(ctx) if p != pipeline_run]
    assert len(lineage_runs) == 4                                # target, data, the drafts, the report
    registered = entries(ctx)
    report = str((ctx.results.eval_dir / "report.json").resolve())
    for kind in KINDS:
        entry = registered[kind]
        assert entry.status == "promoted" and entry.report_path == report
        assert [ref.type for ref in entry.lineage] == ["target", "dataset", "draft", "report"]
        read_back = logged_chain(ctx.artifacts.wandb_dir, entry.lineage[-1], along=entry.lineage)
        assert [(a.name, a.digest) for a in read_back] == [(r.name, r.digest) for r in entry.lineage]
        assert read_back[1].metadata["path"] == str(ctx.results.dataset.resolve())
        assert read_back[2].metadata["path"] == entry.path
    assert registry_main(["--registry", str(ctx.artifacts.root), "show", registered["eagle"].id]) == 0
    assert "lineage: target -> dataset -> draft -> report" in capsys.readouterr().out   # `draftsmith drafts show`

    again = stage_register(ctx)                                  # the cached rerun
    assert again["lineage"] == "cached" and all(again[kind] == "cached" for kind in KINDS), again
    assert len(run_dirs(ctx)) == 5
    assert {k: e.lineage for k, e in entries(ctx).items()} == {k: e.lineage for k, e in registered.items()}


def test_a_wandb_failure_costs_the_lineage_not_the_registration(tmp_path, monkeypatch):
    class BrokenLineage:
        def log_pipeline_run(self, *args, **kwargs):
            raise RuntimeError("wandb-core exited\nwith status 1")

    monkeypatch.setattr("draftsmith.train.registry.lineage.lineage_for", lambda settings, wandb_dir: BrokenLineage())
    ctx = register_context(tmp_path)
    fields = stage_register(ctx)
    assert fields["lineage"] == "failed"
    assert fields["lineage_error"] == "RuntimeError: wandb-core exited with status 1"   # one log line
    assert all(fields[kind] == "added" for kind in KINDS)
    assert all(e.status == "promoted" and e.lineage == [] for e in entries(ctx).values())


def test_disabled_wandb_registers_without_lineage(tmp_path):
    ctx = register_context(tmp_path, mode="disabled")
    fields = stage_register(ctx)
    assert fields["lineage"] == "disabled" and all(fields[kind] == "added" for kind in KINDS)
    assert run_dirs(ctx) == [] and all(e.lineage == [] for e in entries(ctx).values())
