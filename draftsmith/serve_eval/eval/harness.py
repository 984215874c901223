"""The eval harness: each domain x method x K x temperature through the engine -> report rows.

Methods: `no-spec` (the baseline, K=0), `ngram`, one label per draft (its kind, or the caller's
name), and transformers' assisted generation as an external reference (`assisted`, K>0, with the
standalone draft as assistant, and `hf`, K=0, transformers' plain generate, its own baseline).
Each cell runs `warmup` unmeasured requests, then `repetitions` passes over the domain's prompts,
interleaved across methods with the order rotated each pass; ms/token is the median pass, and
alpha, tau and speed-up carry 95% bootstrap intervals over prompts (serve_eval.eval.bootstrap).
Every figure comes from serve_eval.speculative.metrics; speed-ups divide by the no-spec ms/token of the
same domain and temperature measured in this run (`assisted` by `hf`'s: same framework).
A method, draft or domain that cannot run becomes a SkippedEntry with its reason; the rest still run.
"""
from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from draftsmith.drafts.artifacts import Artifacts
from draftsmith.serve_eval.eval.interleave import rotation
from draftsmith.serve_eval.eval.intervals import add_intervals
from draftsmith.serve_eval.eval.parity import parity_rows
from draftsmith.serve_eval.eval.recommend import DraftRoute, Recommendations, Thresholds, recommend, write_recommendations
from draftsmith.serve_eval.eval.report import BASELINE_METHOD, Report, ResultRow, SkippedEntry, TargetInfo
from draftsmith.serve_eval.eval.report_files import ReportFiles, log_to_wandb, write_report
from draftsmith.serve_eval.eval.rows import build_row, looping_cells
from draftsmith.serve_eval.eval.runners import RunResult, Runner, RunSpec
from draftsmith.serve_eval.eval.sources import DraftSource
from draftsmith.serve_eval.eval.variants import mark_variants
from draftsmith.serve_eval.schemas import EvalConfig

log = logging.getLogger(__name__)

HF_BASELINE = "hf"          # transformers' generate without assistant: the baseline of `assisted`
ASSISTED = "assisted"
RECOMMENDATIONS_FILE = "recommendations.yaml"


# ----------------------------------------------------------------------------- the plan

@dataclass
class MethodPlan:
    method: str                      # report label
    K: int
    spec_method: str | None = None   # engine SpecConfig.method; None = plain decoding
    draft_path: Path | None = None
    framework: str = "engine"        # engine | hf
    draft: DraftSource | None = None  # the draft this method runs (its dtype, memory, variant), if any


# (plan) -> Runner; raises to skip the method. Tests pass scripted runners.
RunnerFactory = Callable[[MethodPlan], Runner]


def _check_draft(source: DraftSource, target_dir: Path, cfg: EvalConfig) -> list[str]:
    """Load the draft against the target (ValueError when it cannot serve it) and note its weight bytes at
    the dtype it will run (int weights at their size); returns warnings."""
    import torch

    from draftsmith.drafts.io import ExpectedTarget, load_draft
    from draftsmith.drafts.quant import weight_bytes
    from draftsmith.serve_eval.engine.model_executor import resolve_dtype

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_draft(source.path, ExpectedTarget.from_model_dir(target_dir),
                            strict_fingerprint=cfg.strict_fingerprint)
    dtype = resolve_dtype(source.draft_dtype or cfg.engine.dtype, cfg.engine.device)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    source.weight_bytes = weight_bytes(loaded.model, float_itemsize=itemsize)
    return [str(w.message) for w in caught]


def plan_methods(cfg: EvalConfig, drafts: list[DraftSource], target_dir: Path,
                 skipped: list[SkippedEntry], notes: list[str]) -> list[MethodPlan]:
    """Every (method, K) this run measures, no-spec first; unusable drafts go to `skipped`."""
    ks = cfg.ks_of
    plans = [MethodPlan(BASELINE_METHOD, 0)] if BASELINE_METHOD in cfg.methods else []
    if not plans:
        notes.append(f"eval.methods omits {BASELINE_METHOD!r}: acceptance only (alpha, tau, a_k); no speed-ups")
    if "ngram" in cfg.methods:
        plans += [MethodPlan("ngram", k, "ngram") for k in ks("ngram")]
    usable: list[DraftSource] = []
    if "drafts" in cfg.methods or ASSISTED in cfg.methods:
        notes += mark_variants(drafts, cfg.engine.device)
        for source in drafts:
            try:
                notes += [f"{source.method}: {w}" for w in _check_draft(source, target_dir, cfg)]
                usable.append(source)
            except (ValueError, OSError) as e:
                skipped.append(SkippedEntry("*", source.method, f"draft {source.path} cannot run on this target: {e}"))
    if "drafts" in cfg.methods:
        for source in usable:
            plans += [MethodPlan(source.method, k, source.kind, source.path, draft=source) for k in ks(source.method)]
    if ASSISTED in cfg.methods:
        standalone = [s for s in usable if s.kind == "standalone" and s.quantization is None]
        if standalone:
            plans.append(MethodPlan(HF_BASELINE, 0, framework="hf"))
            plans += [MethodPlan(ASSISTED, k, None, standalone[0].path, "hf") for k in ks(ASSISTED)]
            notes.append(f"{ASSISTED}: transformers generate(assistant_model={standalone[0].path}); its speed-up is "
                         f"relative to {HF_BASELINE!r} (transformers without assistant), whose speed-up is relative "
                         "to our engine's no-spec")
        else:
            skipped.append(SkippedEntry("*", ASSISTED, "no standalone draft for this target to use as assistant"))
    labels = {p.method for p in plans}
    notes += [f"eval.temperatures_of names {m!r}, which this run does not measure (measured: {sorted(labels)})"
              for m in cfg.temperatures_of if m not in labels]
    return plans


# ----------------------------------------------------------------------------- running

@dataclass
class _Cell:
    plan: MethodPlan
    domain: str
    temperature: float
    runs: list[RunResult] = field(default_factory=list)


def _open_runners(plans: list[MethodPlan], factory: RunnerFactory,
                  skipped: list[SkippedEntry]) -> list[tuple[MethodPlan, Runner]]:
    opened = []
    for plan in plans:
        try:
            opened.append((plan, factory(plan)))
        except Exception as e:  # noqa: BLE001 - any failure to build one method must not stop the others
            skipped.append(SkippedEntry("*", plan.method, f"K={plan.K}: cannot start: {type(e).__name__}: {e}"))
    return opened


def runs_at(cfg: EvalConfig, method: str, temperature: float) -> bool:
    """Whether `method` is measured at `temperature` (eval.temperatures_of; the baselines everywhere)."""
    return method in (BASELINE_METHOD, HF_BASELINE) or float(temperature) in cfg.temperatures_for(method)


def _sweep(cfg: EvalConfig, opened: list[tuple[MethodPlan, Runner]], prompts: dict[str, list[str]],
           skipped: list[SkippedEntry], progress: Callable[[str], None]) -> dict[tuple, _Cell]:
    """Repetitions interleaved across methods, the method order rotated each repetition, so that a
    drift of the machine's speed (another job, thermal state) is spread over every method alike."""
    cells: dict[tuple[str, str, int, float], _Cell] = {}
    failed: set[tuple[str, str, int, float]] = set()
    # A runner warms up once per temperature, before its first cell there: the first calls pay the lazy
    # set-up (allocations, the sampling path), later domains find it done.
    warmed: set[tuple[int, float]] = set()
    start = time.perf_counter()
    for rep in range(cfg.repetitions):
        if rep and cfg.max_minutes is not None:
            elapsed = time.perf_counter() - start
            if elapsed + elapsed / rep > 60 * cfg.max_minutes:
                log.warning("eval stopped after %d of %d repetitions by eval.max_minutes=%g (%.1f minutes so far, "
                            "%.1f per repetition; slow or busy CPU)", rep, cfg.repetitions, cfg.max_minutes,
                            elapsed / 60, elapsed / rep / 60)
                break
        for domain, domain_prompts in prompts.items():
            for temperature in cfg.temperatures:
                spec = RunSpec(temperature, cfg.max_tokens, cfg.ignore_eos, cfg.seed, cfg.batch_size, cfg.min_tokens)
                here = [(plan, runner) for plan, runner in opened if runs_at(cfg, plan.method, temperature)]
                if rep > 0:
                    progress(f"eval repetition {rep + 1}/{cfg.repetitions} domain={domain} T={temperature:g} "
                             f"({len(here)} methods)")
                for plan, runner in rotation(here, rep):
                    key = (domain, plan.method, plan.K, float(temperature))
                    if key in failed:
                        continue
                    if rep == 0:
                        progress(f"eval domain={domain} method={plan.method} K={plan.K} T={temperature:g}")
                    try:
                        if cfg.warmup and (id(runner), float(temperature)) not in warmed:
                            runner.run(domain_prompts[:cfg.warmup], spec, domain)
                            warmed.add((id(runner), float(temperature)))
                        run = runner.run(domain_prompts, spec, domain)
                    except Exception as e:  # noqa: BLE001 - a failing cell is reported, the sweep goes on
                        failed.add(key)
                        cells.pop(key, None)
                        skipped.append(SkippedEntry(domain, plan.method,
                                                    f"K={plan.K} T={temperature:g}: {type(e).__name__}: {e}"))
                        continue
                    cells.setdefault(key, _Cell(plan, domain, temperature)).runs.append(run)
    return cells


def _baseline_of(cell: _Cell, baselines: dict[tuple[str, str, float], _Cell]) -> _Cell | None:
    """The cell this cell's speed-up divides by: no-spec's of its (domain, T); `assisted` uses `hf`'s.
    no-spec itself gets None here and its own figure in build_row (speed-up exactly 1)."""
    method = HF_BASELINE if cell.plan.method == ASSISTED else BASELINE_METHOD
    return baselines.get((method, cell.domain, cell.temperature))


def run_cells(cfg: EvalConfig, plans: list[MethodPlan], prompts: dict[str, list[str]], factory: RunnerFactory,
              skipped: list[SkippedEntry], progress: Callable[[str], None] = log.info,
              notes: list[str] | None = None) -> list[ResultRow]:
    """Measure every plan x domain x temperature; rows with speed-ups against this run's baselines,
    and bootstrap intervals over prompts. `notes` gets one line per thread rule the runs' engines applied."""
    opened = _open_runners(plans, factory, skipped)
    try:
        cells = _sweep(cfg, opened, prompts, skipped, progress)
    finally:
        for _, runner in opened:
            runner.close()
    if notes is not None:
        rules = sorted({run.threads for cell in cells.values() for run in cell.runs if run.threads})
        notes += [f"torch intra-op threads: {rule}" for rule in rules]
    rows: list[ResultRow] = []
    baselines: dict[tuple[str, str, float], _Cell] = {}
    baseline_ms: dict[tuple[str, str, float], float] = {}
    # Baselines first (no-spec, then hf whose own baseline is no-spec), then everything else.
    order = sorted(cells.values(), key=lambda c: (c.plan.method != BASELINE_METHOD, c.plan.method != HF_BASELINE))
    for cell in order:
        base = _baseline_of(cell, baselines)
        base_ms = None if base is None else baseline_ms[(base.plan.method, base.domain, base.temperature)]
        try:
            row = build_row(cell.domain, cell.plan.method, cell.plan.K, cell.temperature, cell.runs, base_ms)
        except ValueError as e:
            skipped.append(SkippedEntry(cell.domain, cell.plan.method, str(e)))
            continue
        add_intervals(row, cell.runs, None if base is None else base.runs, cfg.seed)
        if cell.plan.draft is not None:
            draft = cell.plan.draft
            row.draft_bytes, row.quantization, row.variant_of = draft.weight_bytes, draft.quantization, draft.variant_of
        if cell.plan.K == 0:
            baselines[(cell.plan.method, cell.domain, cell.temperature)] = cell
            baseline_ms[(cell.plan.method, cell.domain, cell.temperature)] = row.ms_per_token
        rows.append(row)
    return rows


def default_runner_factory(cfg: EvalConfig, target_dir: Path) -> RunnerFactory:
    """Engines share one executor (the target's weights load once); hf runners load transformers."""
    shared: dict[str, Any] = {}

    def factory(plan: MethodPlan) -> Runner:
        from draftsmith.serve_eval.eval import runners

        if plan.framework == "hf":
            return runners.HFRunner(target_dir, plan.method, plan.K, plan.draft_path if plan.K else None,
                                    cfg.engine.dtype, cfg.engine.device)
        if "executor" not in shared:
            from draftsmith.serve_eval.engine.model_executor import ModelExecutor

            e = cfg.engine
            shared["executor"] = ModelExecutor(target_dir, e.dtype, e.device, e.attn_backend)
        return runners.build_engine_runner(target_dir, plan.method, plan.K, cfg.engine, cfg.seed, plan.spec_method,
                                           plan.draft_path, shared["executor"], cfg.strict_fingerprint,
                                           plan.draft.draft_dtype if plan.draft else None)

    return factory


def run_eval(cfg: EvalConfig, target_dir: Path, fingerprint: str, prompts: dict[str, list[str]],
             drafts: list[DraftSource], skipped: list[SkippedEntry] | None = None,
             factory: RunnerFactory | None = None, progress: Callable[[str], None] = log.info) -> Report:
    """Plan, measure and assemble the Report (recommendations included); writes nothing."""
    skipped = list(skipped or [])
    notes: list[str] = []
    plans = plan_methods(cfg, drafts, Path(target_dir), skipped, notes)
    rows = run_cells(cfg, plans, prompts, factory or default_runner_factory(cfg, Path(target_dir)), skipped, progress,
                     notes)
    notes += looping_cells(rows)
    return assemble_report(cfg, str(target_dir), fingerprint, prompts, rows, skipped, notes,
                           {d.method: DraftRoute(str(d.path), d.kind, d.draft_dtype) for d in drafts})


def assemble_report(cfg: EvalConfig, target_path: str, fingerprint: str, prompts: dict[str, list[str]],
                    rows: list[ResultRow], skipped: list[SkippedEntry], notes: list[str],
                    drafts: dict[str, DraftRoute]) -> Report:
    """The Report of measured rows; `drafts` (method -> what serves it) names what the recommendations load."""
    recs = recommend(rows, Thresholds(cfg.min_alpha, cfg.min_speedup), fingerprint, drafts=drafts)
    paths = {method: route.path for method, route in drafts.items()}
    config = {**asdict(cfg), "notes": notes, "prompts_per_domain": {d: len(p) for d, p in sorted(prompts.items())},
              "drafts": paths, "draft_kinds": {method: route.kind for method, route in drafts.items() if route.kind}}
    parity = [p.to_dict() for p in parity_rows(rows, paths)]
    return Report(TargetInfo(target_path, fingerprint), config, rows, skipped, recs.to_dict(), parity)


# ----------------------------------------------------------------------------- outputs

def report_dir(artifacts_root: str | Path, fingerprint: str, out_dir: str | None = None) -> Path:
    if out_dir:
        return Path(out_dir)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    return Artifacts(Path(artifacts_root)).target_home(fingerprint) / "reports" / stamp


def write_outputs(report: Report, out_dir: Path, plots: bool = True, wandb_run: Any = None) -> ReportFiles:
    """report.json / report.md / PNGs, recommendations.yaml beside them, tables + plots to W&B."""
    files = write_report(report, out_dir, plots=plots)
    # The report's own choices (made with the drafts' kinds and dtypes); a report without any gets them from its rows.
    recs = (Recommendations.from_dict(report.recommendations, "report.recommendations") if report.recommendations
            else recommend(report.results, target_fingerprint=report.target.fingerprint))
    write_recommendations(recs, out_dir / RECOMMENDATIONS_FILE)
    log_to_wandb(report, files.plots, wandb_run)
    return files


def evaluate(*, target_dir: str | Path, drafts: dict[str, Path], domains: list[str], profile: str,
             overrides: list[str]) -> Report:
    """The retrain hook's entry: evaluate `drafts` (rows labelled by their keys) on `target_dir`.

    Empty `domains` = every domain of the held-out prompts; `profile` names conf/eval/<profile>.yaml
    ("quick": a small subset at one (K, T) point). Drafts load with strict_fingerprint=False (an old
    draft on a new target is the point). Writes nothing: the caller saves the report.
    """
    from draftsmith.drafts.identity import target_fingerprint
    from draftsmith.serve_eval.eval.settings import load_settings, validate
    from draftsmith.serve_eval.eval.sources import collect_drafts, gather_prompts

    settings = load_settings(profile, overrides)
    cfg = settings.eval
    cfg.domains = list(domains) or cfg.domains
    cfg.drafts = {name: str(p) for name, p in drafts.items()}
    cfg.discover_drafts = False
    cfg.strict_fingerprint = False
    if cfg.drafts and "drafts" not in cfg.methods:
        cfg.methods = [*cfg.methods, "drafts"]
    validate(cfg)
    target_dir = Path(target_dir)
    fingerprint = target_fingerprint(target_dir)
    prompts, skipped = gather_prompts(cfg, settings.artifacts_root, target_dir)
    sources = collect_drafts(cfg.drafts, settings.artifacts_root, fingerprint, discover=False)
    return run_eval(cfg, target_dir, fingerprint, prompts, sources, skipped)
