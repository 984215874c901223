"""Pipeline stages ``eval``, ``report`` and ``register``: measure this run's drafts, summarise, file them.

``eval`` runs the eval harness (``draftsmith.serve_eval.eval.run.run``) on the target's held-out corpus split, per
domain, for no-spec, n-gram and exactly the drafts this run distilled (labelled by kind; older drafts
in the same drafts dir are not swept in), with ``pipeline.eval`` over the ``eval`` group. The report
lands in ``artifacts/targets/<fp>/reports/<stamp>-pipeline-<key>/``, key = hash(target, prompts,
eval settings, draft dirs), and a ``.complete`` marker makes the next run with the same inputs a cache hit.

``report`` turns report.json into one table (domain x method: alpha, tau, ms/token, speed-up; the best
K per temperature) that the pipeline prints last, and writes it to ``summary.md`` beside the report.
``register`` files each draft in the registry (``draftsmith.train.registry``) as promoted, with that report, and
logs its lineage (target -> data -> draft -> report) as W&B artifacts into the entry, as the retrain
hook does; a W&B failure costs the lineage, never the registration.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf, open_dict

from draftsmith.drafts.files import stable_hash
from draftsmith.serve_eval.eval.report_files import fmt_with_interval
from draftsmith.train.pipeline.context import PipelineContext, SummaryReport, need
from draftsmith.train.pipeline.distill import DONE_MARKER, as_dict, merge_checked

if TYPE_CHECKING:  # (annotations only: the stages import the registry when they run)
    from draftsmith.train.registry.records import DraftEntry, RegisteredTarget
    from draftsmith.train.registry.store import Registry

REPORT_SUFFIX = "-pipeline-"
SUMMARY_FILE = "summary.md"
# Eval settings that change where/how a report is written, not what it measures: left out of the key.
_UNKEYED_EVAL_FIELDS = ("out_dir", "plots", "wandb")


def check_eval_settings(cfg: DictConfig) -> Any:
    """``pipeline.eval`` over the ``eval`` group must make a valid EvalConfig (ValueError naming the field)."""
    from draftsmith.serve_eval.eval.settings import validate

    settings = OmegaConf.to_object(merge_checked(cfg.eval, cfg.pipeline.eval, "pipeline.eval"))
    validate(settings)
    return settings


def eval_node(ctx: PipelineContext) -> DictConfig:
    """The ``eval`` group + ``pipeline.eval``, aimed at this target, its held-out prompts and this run's drafts."""
    cfg, target = ctx.cfg, need(ctx.results.target, "target")
    node = merge_checked(cfg.eval, cfg.pipeline.eval, "pipeline.eval")
    drafts = {label: str(path) for label, path in {**ctx.results.drafts, **ctx.results.variants}.items()}
    prompts = node.prompts or str(need(ctx.results.corpus, "corpus").path("eval"))
    return merge_checked(node, {"target": str(target.model_dir), "prompts": prompts, "drafts": drafts,
                         "discover_drafts": False}, "eval")


def eval_key(ctx: PipelineContext, node: DictConfig) -> str:
    settings = {k: v for k, v in as_dict(node).items() if k not in _UNKEYED_EVAL_FIELDS}
    prompts, corpus = Path(node.prompts), need(ctx.results.corpus, "corpus")
    return stable_hash({"target": need(ctx.results.target, "target").fingerprint, "eval": settings,
                        "prompts": corpus.content_hash if prompts == corpus.path("eval")
                        else stable_hash(prompts.read_text() if prompts.is_file() else str(prompts))})


def stage_eval(ctx: PipelineContext) -> dict[str, Any]:
    from draftsmith.serve_eval.eval.run import run as run_eval

    target = need(ctx.results.target, "target")
    node = eval_node(ctx)
    key = eval_key(ctx, node)
    reports = ctx.artifacts.reports_dir(target.fingerprint)
    done = sorted(p for p in reports.glob(f"*{REPORT_SUFFIX}{key}") if (p / DONE_MARKER).is_file())
    cached = bool(done) and not ctx.forced("eval")
    if cached:
        out_dir = done[-1]
    else:
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
        out_dir = reports / f"{stamp}{REPORT_SUFFIX}{key}"
        job = ctx.cfg.copy()
        with open_dict(job):
            job.eval = merge_checked(node, {"out_dir": str(out_dir)}, "eval")
        run_eval(job)
        (out_dir / DONE_MARKER).write_text("")
    ctx.results.eval_dir = out_dir
    return {"cached": cached, "dir": out_dir, "methods": ",".join([m for m in node.methods if m != "drafts"] + list(node.drafts)),
            "K": ",".join(map(str, node.num_speculative_tokens)), "T": ",".join(f"{t:g}" for t in node.temperatures)}


# ----------------------------------------------------------------------------- the summary table


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None or not math.isfinite(x) else format(x, spec)


def summary_rows(report: Any) -> list[list[str]]:
    """One row per (domain, method, temperature): the K with the best speed-up (no-spec: K = 0)."""
    best: dict[tuple[str, str, float], Any] = {}
    for r in report.results:
        cell = (r.domain, r.method, r.temperature)
        score = r.speedup if r.speedup is not None else -math.inf
        held = best.get(cell)
        if held is None or score > (held.speedup if held.speedup is not None else -math.inf):
            best[cell] = r
    order = sorted(best.values(), key=lambda r: (r.domain, r.temperature, r.method != "no-spec", r.method))
    return [[r.domain, r.method, f"{r.temperature:g}", str(r.K), fmt_with_interval(r.alpha, r.alpha_ci),
             fmt_with_interval(r.tau, r.tau_ci, ".2f"), _fmt(r.ms_per_token, ".2f"),
             fmt_with_interval(r.speedup, r.speedup_ci, ".2f")] for r in order]


def render_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(c.ljust(w) if i < 2 else c.rjust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def stage_report(ctx: PipelineContext) -> dict[str, Any]:
    from draftsmith.serve_eval.eval.report import load_report
    from draftsmith.serve_eval.eval.rows import looping_cells

    out_dir = need(ctx.results.eval_dir, "eval")
    report = load_report(out_dir / "report.json")
    header = ["domain", "method", "T", "K", "alpha [95% CI]", "tau [95% CI]", "ms/token", "speedup [95% CI]"]
    table = render_table(header, summary_rows(report))
    notes = [f"skipped: domain={s.domain} method={s.method}: {s.reason}" for s in report.skipped]
    notes += [f"warning: {line}" for line in ctx.results.recipe_warnings]
    notes += [f"parity: {p['method']} {p['domain']} K={p['K']} T={p['temperature']:g}: served tau "
                f"{p['served_tau']:.2f} vs {p['simulated_tau']:.2f} from training: {p['flag']}"
                for p in report.parity if p["flag"]]
    notes += looping_cells(report.results)
    cost = "\n".join(ctx.results.cost.lines if ctx.results.cost else [])  # (the cost stage's lines, if it ran)
    (out_dir / SUMMARY_FILE).write_text(f"```\n{table}\n```\n" + "".join(f"\n- {s}" for s in notes) + "\n"
                                        + (f"\n```\n{cost}\n```\n" if cost else ""))
    ctx.results.report = SummaryReport(table, notes, out_dir / "report.json", out_dir / "report.md")
    domains = sorted({r.domain for r in report.results})
    methods = sorted({r.method for r in report.results})
    return {"report": out_dir / "report.json", "domains": ",".join(domains), "methods": ",".join(methods),
            "rows": len(report.results), "skipped": len(report.skipped)}


def print_report(ctx: PipelineContext) -> None:
    report = ctx.results.report
    if report is None:
        return
    print("\nspeculative decoding on the held-out prompts (best K per method and temperature; "
          "speedup = no-spec ms/token / method ms/token, same run):")
    print(report.table)
    for line in report.notes:
        print(line)
    print(f"report: {report.json}\nreport (tables, plots): {report.markdown}")
    if ctx.results.registry_manifest is not None:
        print(f"registry: {ctx.results.registry_manifest}")


# ----------------------------------------------------------------------------- the registry


def stage_register(ctx: PipelineContext) -> dict[str, Any]:
    """Each draft of this run -> promoted in the registry, with this run's report and its W&B lineage
    (idempotent on reruns)."""
    from draftsmith.train.registry.records import RegisteredTarget
    from draftsmith.train.registry.store import Registry

    target = need(ctx.results.target, "target")
    report_path = (need(ctx.results.eval_dir, "eval") / "report.json").resolve()
    registry = Registry(ctx.artifacts.root)
    info = RegisteredTarget.from_dir(target.model_dir)
    fields: dict[str, Any] = {}
    entries: dict[str, DraftEntry] = {}
    for kind, draft_dir in ctx.results.drafts.items():
        path = str(Path(draft_dir).resolve())
        entry = next((e for e in registry.entries(info.fingerprint) if e.path == path and e.status != "retired"), None)
        if entry is None:
            entry = registry.add(path, info, report_path=report_path, report_method=kind, status="promoted",
                                 note=f"draftsmith pipeline ({ctx.cfg.pipeline.name})")
            fields[kind] = "added"
        elif entry.report_path == str(report_path) and entry.status == "promoted":
            fields[kind] = "cached"
        else:
            registry.update(entry.id, report_path=str(report_path), report_method=kind)
            entry = registry.promote(entry.id)
            fields[kind] = "promoted"
        entries[kind] = entry
    fields.update(_register_lineage(ctx, registry, info, entries, report_path))
    ctx.results.registry_manifest = registry.manifest_path(info.fingerprint)
    return {**fields, "manifest": registry.manifest_path(info.fingerprint)}


def _register_lineage(ctx: PipelineContext, registry: Registry, target: RegisteredTarget,
                      entries: dict[str, DraftEntry], report_path: Path) -> dict[str, Any]:
    """Log the lineage of the drafts whose entry has none ending in this report (a cached rerun logs
    nothing) and store it in their entries. W&B's errors are many and unrelated to the drafts: one
    costs the lineage, is reported in the stage's line, and the drafts stay registered."""
    from draftsmith.train.logs import WandbSettings
    from draftsmith.train.registry.lineage import lineage_for, report_artifact_name

    settings = WandbSettings.from_config(ctx.cfg)
    if settings.mode == "disabled":
        return {"lineage": "disabled"}
    name = report_artifact_name(report_path)
    todo = {kind: e for kind, e in entries.items()
            if not (e.lineage and e.lineage[-1].type == "report" and e.lineage[-1].name == name)}
    if not todo:
        return {"lineage": "cached" if entries else "none"}
    dataset = ctx.results.dataset
    if dataset is None:   # drafts from a run without a generate stage: no data link to log
        return {"lineage": "skipped", "lineage_error": "no generate stage in this run"}
    try:
        chains = lineage_for(settings, ctx.artifacts.wandb_dir).log_pipeline_run(
            target, dataset, {kind: Path(e.path) for kind, e in todo.items()}, report_path)
    except Exception as err:  # noqa: BLE001 - see the docstring
        return {"lineage": "failed", "lineage_error": " ".join(f"{type(err).__name__}: {err}".split())}
    for kind, entry in todo.items():
        registry.update(entry.id, lineage=chains[kind])
    return {"lineage": "logged", "lineage_drafts": ",".join(todo)}
