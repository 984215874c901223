"""The report's files: report.json (atomic), the plots, report.md linking them, and the W&B tables.

Split from `report` (the record and its loader) so that the plots, which read the record, and the
writer, which draws the plots, import one way: report_files -> plots -> report.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from draftsmith.serve_eval.eval.plots import write_plots
from draftsmith.drafts.files import atomic_write_text
from draftsmith.serve_eval.eval.report import BASELINE_METHOD, Report, ResultRow
from draftsmith.serve_eval.eval.variants import variant_comparisons


# ----------------------------------------------------------------------------- markdown

def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def fmt_with_interval(x: float | None, ci: list[float] | None, spec: str = ".3f") -> str:
    """'0.612 [0.551, 0.668]': the figure and its 95% bootstrap interval over prompts."""
    if x is None:
        return "-"
    return format(x, spec) if ci is None else f"{x:{spec}} [{ci[0]:{spec}}, {ci[1]:{spec}}]"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    # A "|" or newline inside a cell (e.g. in a skip reason) would break the Markdown table.
    clean = lambda cell: cell.replace("|", "\\|").replace("\n", " ")  # noqa: E731
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(clean(c) for c in r) + " |" for r in rows]
    return out


def render_markdown(report: Report, plot_files: dict[str, Path] | None = None) -> str:
    lines = ["# draftsmith eval report", "",
             f"- target: `{report.target.path}` (fingerprint `{report.target.fingerprint}`)",
             f"- created: {report.created}", f"- schema_version: {report.schema_version}", ""]
    domains = sorted({r.domain for r in report.results})
    header = ["method", "K", "T", "alpha [95% CI]", "tau [95% CI]", "ms/token (median)", "± std", "tok/s",
              "speed-up [95% CI]", "predicted",
              "TTFT p50/p99 ms", "ITL p50/p99 ms", "draft/target share", "reps"]
    for domain in domains:
        rows = sorted((r for r in report.results if r.domain == domain),
                      key=lambda r: (r.method != BASELINE_METHOD, r.method, r.K, r.temperature))
        lines += [f"## {domain}", ""]
        lines += _table(header, [[
            r.method, str(r.K), f"{r.temperature:g}", fmt_with_interval(r.alpha, r.alpha_ci),
            fmt_with_interval(r.tau, r.tau_ci, ".2f"), f"{r.ms_per_token:.2f}",
            f"{r.spread:.2f}", f"{r.tokens_per_s:.1f}", fmt_with_interval(r.speedup, r.speedup_ci, ".2f"),
            _fmt(r.predicted_speedup, ".2f"),
            f"{_ms(r.ttft_p50)} / {_ms(r.ttft_p99)}", f"{_ms(r.itl_p50)} / {_ms(r.itl_p99)}",
            f"{_fmt(r.draft_time_share, '.2f')} / {_fmt(r.target_time_share, '.2f')}", str(r.repetitions),
        ] for r in rows])
        spec_rows = [r for r in rows if r.a_k]
        if spec_rows:
            width = max(len(r.a_k) for r in spec_rows)
            lines += ["", "Per-position acceptance a_k:", ""]
            lines += _table(["method", "K", "T"] + [f"a_{k}" for k in range(1, width + 1)], [
                [r.method, str(r.K), f"{r.temperature:g}"] + [f"{a:.3f}" for a in r.a_k] + ["-"] * (width - len(r.a_k))
                for r in spec_rows])
        lines.append("")
    lines += _variants_md(report.results)
    lines += _recommendations_md(report.recommendations)
    lines += _parity_md(report.parity)
    if report.skipped:
        lines += ["## Skipped", ""]
        lines += _table(["domain", "method", "reason"], [[s.domain, s.method, s.reason] for s in report.skipped])
        lines.append("")
    if plot_files:
        lines += ["## Plots", ""]
        lines += [f"![{name}]({Path(p).name})" for name, p in plot_files.items()]
        lines.append("")
    return "\n".join(lines)


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def _variants_md(rows: list[ResultRow]) -> list[str]:
    """Each quantized variant beside the draft it was quantized from, per domain, T and K."""
    comparisons = variant_comparisons(rows)
    if not comparisons:
        return []
    lines = ["## Quantized variants", "",
             "Each variant beside its source draft (both run the draft at bf16, the int kernels' activation dtype). "
             "alpha cost = source alpha - variant alpha (points); draft step x = source draft ms per round / the "
             "variant's; c = draft ms per round / (K x no-spec ms/token); memory = the draft's weights as held.", ""]
    header = ["domain", "T", "K", "method", "alpha [95% CI]", "alpha cost", "tau [95% CI]", "draft ms/round",
              "draft step x", "c", "speed-up [95% CI]", "draft MiB"]
    table: list[list[str]] = []
    shown: set[tuple] = set()
    for c in comparisons:
        key = (c.domain, c.temperature, c.K, c.source.method)
        for r, is_source in ((c.source, True), (c.variant, False)):
            if is_source and key in shown:
                continue
            shown.add(key)
            cost = None if is_source or c.alpha_cost is None else 100 * c.alpha_cost
            step = None if is_source else c.draft_step_speedup
            memory = _mib(r.draft_bytes) + ("" if is_source or c.memory_ratio is None else f" ({c.memory_ratio:.2f}x)")
            table.append([c.domain, f"{c.temperature:g}", str(c.K), r.method, fmt_with_interval(r.alpha, r.alpha_ci),
                          _fmt(cost, "+.1f"), fmt_with_interval(r.tau, r.tau_ci, ".2f"),
                          _fmt(r.draft_ms_per_round, ".2f"), _fmt(step, ".2f"), _fmt(r.cost_ratio, ".3f"),
                          fmt_with_interval(r.speedup, r.speedup_ci, ".2f"), memory])
    return lines + _table(header, table) + [""]


def _recommendations_md(recs: dict[str, Any]) -> list[str]:
    if not recs or not recs.get("domains"):
        return []
    thresholds = recs.get("thresholds", {})
    lines = ["## Recommendations", "",
             f"Per domain and temperature; speculation is disabled where the lower end of the 95% interval of "
             f"the speed-up is < {thresholds.get('min_speedup', '?')}"
             + (f" or of alpha < {thresholds['min_alpha']}" if thresholds.get("min_alpha") else "") + ". "
             "A server loading the file falls back to direct decoding where live alpha drops below the choice's "
             "break-even alpha (where its measured speed-up would reach 1).", ""]
    lines += _table(["domain", "T", "speculate", "method", "K", "alpha (low)", "speed-up (low)",
                     "falls back below alpha", "reason"], [[
        name, f"{e.get('temperature', 0):g}", "yes" if e.get("speculate") else "no", str(e.get("method")),
        str(e.get("K")), f"{_fmt(e.get('alpha'))} ({_fmt(e.get('alpha_low'))})",
        f"{_fmt(e.get('speedup'), '.2f')} ({_fmt(e.get('speedup_low'), '.2f')})",
        _fmt(e.get("fallback_below_alpha")) if e.get("speculate") else "-", str(e.get("reason", ""))]
        for name, e in recommendation_entries(recs)])
    return lines + [""]


def _parity_md(parity: list[dict[str, Any]]) -> list[str]:
    if not parity:
        return []
    lines = ["## Training vs serving", "",
             "Per draft: tau its training run predicted (simulated from held-out per-position accuracy) beside "
             "the served tau at the same K; a gap over 0.5 is flagged with its likeliest cause.", ""]
    lines += _table(["method", "domain", "K", "T", "simulated tau", "served tau", "gap", "flag"], [[
        p["method"], p["domain"], str(p["K"]), f"{p['temperature']:g}", f"{p['simulated_tau']:.2f}",
        f"{p['served_tau']:.2f}", f"{p['gap']:+.2f}", p["flag"] or ""] for p in parity])
    return lines + [""]


def recommendation_entries(recs: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(domain label, choice) for the default (one per temperature) and then every domain."""
    entries = [("(default)", e) for e in recs.get("default") or []]
    return entries + [(name, e) for name, choices in sorted(recs["domains"].items()) for e in choices]


# ----------------------------------------------------------------------------- writing

@dataclass
class ReportFiles:
    json: Path
    markdown: Path
    plots: dict[str, Path]


def write_report(report: Report, out_dir: str | Path, plots: bool = True) -> ReportFiles:
    """report.json (atomic), the plots, then report.md linking them, all in `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "report.json"
    data = report.to_dict()
    Report.from_dict(data, source="report to write")  # never write a report that load_report would refuse
    atomic_write_text(json_path, json.dumps(data, indent=2, allow_nan=False) + "\n")
    plot_files: dict[str, Path] = {}
    if plots:
        plot_files = write_plots(report.results, out_dir)
    md_path = out_dir / "report.md"
    atomic_write_text(md_path, render_markdown(report, plot_files))
    return ReportFiles(json_path, md_path, plot_files)


def log_to_wandb(report: Report, plot_files: dict[str, Path] | None = None, run: Any = None) -> bool:
    """Log the results/skipped/recommendation tables and the plots to a W&B run.

    Uses `run` or the active `wandb.run`; does nothing (returns False) when wandb is not
    installed, disabled (WANDB_MODE=disabled) or no run is active, so offline use never fails.
    """
    if os.environ.get("WANDB_MODE", "").lower() == "disabled" and run is None:
        return False
    try:
        import wandb
    except ImportError:
        return False
    run = run if run is not None else wandb.run
    if run is None or getattr(run, "disabled", False):
        return False
    cols = [f.name for f in fields(ResultRow) if f.name != "ms_per_token_samples"]
    data = [[json.dumps(getattr(r, c)) if c == "a_k" else getattr(r, c) for c in cols] for r in report.results]
    payload: dict[str, Any] = {"eval/results": wandb.Table(columns=cols, data=data)}
    if report.skipped:
        payload["eval/skipped"] = wandb.Table(columns=["domain", "method", "reason"],
                                              data=[[s.domain, s.method, s.reason] for s in report.skipped])
    domains = report.recommendations.get("domains", {}) if report.recommendations else {}
    if domains:
        rec_cols = ["domain", "temperature", "speculate", "method", "K", "alpha", "alpha_low", "speedup",
                    "speedup_low", "reason"]
        payload["eval/recommendations"] = wandb.Table(
            columns=rec_cols, data=[[name] + [e.get(c) for c in rec_cols[1:]]
                                    for name, e in recommendation_entries(report.recommendations)])
    for name, path in (plot_files or {}).items():
        payload[f"eval/plots/{name}"] = wandb.Image(str(path))
    run.log(payload)
    return True
