"""`draftsmith eval`: the job body `run(cfg)`. Its Hydra door is `draftsmith.train.jobs` (serve_eval does not import
train, where conf/ and the schema registry live): `draftsmith eval ...` or `python -m draftsmith.train.jobs eval ...`.
`python -m draftsmith.serve_eval.eval.run compare A B` works without train.

    draftsmith eval                                   # every method x K x T on the target's held-out prompts
    draftsmith eval eval=quick eval.target=DIR        # a profile (conf/eval/quick.yaml) on a given target
    draftsmith eval eval.mode=endpoint 'eval.endpoints=[{name: no-spec, url: "http://127.0.0.1:8000"}]'
    draftsmith eval compare A B                       # deltas between two reports (compare.main)

Writes report.json / report.md / PNGs and recommendations.yaml under
<artifacts>/targets/<fingerprint>/reports/<stamp>/ (or eval.out_dir), and logs them to W&B.
"""
from __future__ import annotations

import hashlib
import logging
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def _eval_config(cfg: Any) -> Any:
    from omegaconf import OmegaConf

    from draftsmith.serve_eval.eval.settings import validate
    from draftsmith.serve_eval.schemas import EvalConfig

    node = cfg.eval
    if OmegaConf.get_type(node) is not EvalConfig:  # composed from another schema (should not happen)
        node = OmegaConf.merge(OmegaConf.structured(EvalConfig), OmegaConf.masked_copy(node, list(node.keys())))
    eval_cfg = OmegaConf.to_object(node)
    validate(eval_cfg)
    return eval_cfg


def _init_wandb(cfg: Any, artifacts_root: Path, fingerprint: str) -> Any:
    """An offline/online W&B run for this eval, or None (disabled, or wandb not installed)."""
    mode = str(cfg.wandb.mode)
    if mode == "disabled":
        return None
    try:
        import wandb
    except ImportError:
        return None
    wandb_dir = artifacts_root / "wandb"
    wandb_dir.mkdir(parents=True, exist_ok=True)
    return wandb.init(mode=mode, project=cfg.wandb.project, entity=cfg.wandb.entity, dir=str(wandb_dir),
                      job_type="eval", config={"target_fingerprint": fingerprint}, reinit="finish_previous")


def _print_summary(report: Any, files: Any, out_dir: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"draftsmith eval: {report.target.fingerprint}")
    for col in ("domain", "method", "K", "T", "alpha", "ms/token", "speed-up", "predicted"):
        table.add_column(col, justify="left" if col in ("domain", "method") else "right")
    fmt = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    for r in sorted(report.results, key=lambda r: (r.domain, r.method != "no-spec", r.method, r.K, r.temperature)):
        table.add_row(r.domain, r.method, str(r.K), f"{r.temperature:g}", fmt(r.alpha, ".3f"),
                      f"{r.ms_per_token:.2f}", fmt(r.speedup, ".2f"), fmt(r.predicted_speedup, ".2f"))
    console = Console()
    console.print(table)
    for s in report.skipped:
        console.print(f"skipped: domain={s.domain} method={s.method}: {s.reason}")
    console.print(f"report: {files.markdown}\nrecommendations: {out_dir / 'recommendations.yaml'}")


def run(cfg: Any) -> Path:
    """The job body (cfg: the composed root config). Returns the report directory."""
    from draftsmith.serve_eval.eval.harness import report_dir, run_eval, write_outputs
    from draftsmith.serve_eval.eval.sources import collect_drafts, find_target, gather_prompts

    eval_cfg = _eval_config(cfg)
    artifacts_root = Path(str(cfg.artifacts_root)).expanduser().absolute()
    if eval_cfg.mode == "endpoint":
        from draftsmith.serve_eval.eval.endpoint import run_endpoint_eval

        target = eval_cfg.target or cfg.target.get("path")
        target_dir = Path(target) if target and Path(target).is_dir() else None
        if target_dir is not None:
            from draftsmith.drafts.identity import target_fingerprint

            fingerprint = target_fingerprint(target_dir)
        else:  # the served model is not on this machine: key its reports by the endpoints measured
            urls = ",".join(sorted(e.url for e in eval_cfg.endpoints))
            fingerprint = "endpoint-" + hashlib.sha256(urls.encode()).hexdigest()[:8]
        prompts, skipped = gather_prompts(eval_cfg, artifacts_root, target_dir or artifacts_root)
        report = run_endpoint_eval(eval_cfg, prompts, str(target_dir or target or ""), fingerprint, skipped)
    else:
        from draftsmith.drafts.identity import target_fingerprint

        target_dir = find_target(eval_cfg.target or cfg.target.get("path"), artifacts_root)
        fingerprint = target_fingerprint(target_dir)
        prompts, skipped = gather_prompts(eval_cfg, artifacts_root, target_dir)
        if not prompts:
            raise ValueError("eval: no domain has prompts; " + "; ".join(s.reason for s in skipped))
        sources = collect_drafts(eval_cfg.drafts, artifacts_root, fingerprint, eval_cfg.discover_drafts)
        report = run_eval(eval_cfg, target_dir, fingerprint, prompts, sources, skipped, progress=log.info)
    out_dir = report_dir(artifacts_root, fingerprint, eval_cfg.out_dir)
    wandb_run = _init_wandb(cfg, artifacts_root, fingerprint) if eval_cfg.wandb else None
    try:
        files = write_outputs(report, out_dir, plots=eval_cfg.plots, wandb_run=wandb_run)
    finally:
        if wandb_run is not None:
            wandb_run.finish()
    _print_summary(report, files, out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    """`compare A B` goes to serve_eval.eval.compare; the Hydra job itself starts from train.jobs."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["compare"]:
        from draftsmith.serve_eval.eval.compare import main as compare_main

        raise SystemExit(compare_main(args[1:]))
    print("the eval job runs as `draftsmith eval key=value ...` or `python -m draftsmith.train.jobs eval key=value ...` "
          "(its Hydra config lives in train); here only `compare A B`", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
