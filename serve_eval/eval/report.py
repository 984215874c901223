"""The evaluation report: schema-versioned report.json, human report.md, PNG plots, W&B tables.

The harness fills `ResultRow`s with numbers computed by serve_eval.spec.metrics; this module only
stores, validates, renders and logs them (no metric is computed here).
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
BASELINE_METHOD = "no-spec"  # the method every speed-up is measured against, in the same run


class ReportSchemaError(ValueError):
    """A report file that this version of draftsmith cannot read (wrong schema version or shape)."""


@dataclass
class ResultRow:
    """One (domain, method, K, temperature) cell of an eval run. None = not applicable (no-spec alpha)."""

    domain: str
    method: str
    K: int                              # draft tokens per round; 0 for no-spec
    temperature: float
    alpha: float | None                 # accepted / proposed draft tokens
    tau: float | None                   # tokens emitted per round, bonus included
    a_k: list[float]                    # per-position acceptance, a_k[k-1] for draft position k
    ms_per_token: float                 # decode wall time / generated tokens (mean over repetitions)
    tokens_per_s: float
    speedup: float | None               # baseline ms/token / this ms/token, same run
    predicted_speedup: float | None     # seed formula from measured alpha and cost ratio
    ttft_p50: float | None              # seconds
    ttft_p99: float | None
    itl_p50: float | None               # seconds
    itl_p99: float | None
    draft_time_share: float | None      # share of decode wall time spent proposing
    target_time_share: float | None     # share spent in target forwards (verify / decode)
    repetitions: int
    spread: float                       # std of ms/token over repetitions
    ms_per_token_samples: list[float] = field(default_factory=list)  # one per repetition (plots)


@dataclass
class SkippedEntry:
    domain: str
    method: str
    reason: str


@dataclass
class TargetInfo:
    path: str
    fingerprint: str


@dataclass
class Report:
    target: TargetInfo
    config: dict[str, Any]
    results: list[ResultRow]
    skipped: list[SkippedEntry] = field(default_factory=list)
    recommendations: dict[str, Any] = field(default_factory=dict)  # recommend.Recommendations.to_dict()
    created: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for row in d["results"]:
            # metrics.py answers nan for "no data" (e.g. no rounds); JSON has no nan, the schema has null.
            for key in _OPTIONAL_FLOATS:
                if isinstance(row[key], float) and not math.isfinite(row[key]):
                    row[key] = None
        # Key order as documented: version first, so a reader sees at once what it is looking at.
        order = ("schema_version", "target", "created", "config", "results", "skipped", "recommendations")
        return {k: d[k] for k in order}

    @classmethod
    def from_dict(cls, d: Any, source: str = "report") -> "Report":
        """Validate and build; ReportSchemaError names the source and the offending field."""
        if not isinstance(d, dict):
            raise ReportSchemaError(f"{source}: expected a JSON object, got {type(d).__name__}")
        version = d.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ReportSchemaError(
                f"{source}: schema_version is {version!r} but this draftsmith reads schema_version "
                f"{SCHEMA_VERSION}; regenerate the report with `draftsmith eval` or use the draftsmith "
                f"version that wrote it")
        for key, kind in (("target", dict), ("created", str), ("config", dict), ("results", list),
                          ("skipped", list), ("recommendations", dict)):
            if not isinstance(d.get(key), kind):
                raise ReportSchemaError(f"{source}: field '{key}' must be a {kind.__name__}")
        target = d["target"]
        for key in ("path", "fingerprint"):
            if not isinstance(target.get(key), str):
                raise ReportSchemaError(f"{source}: field 'target.{key}' must be a string")
        results = [_row_from_dict(r, f"{source}: results[{i}]") for i, r in enumerate(d["results"])]
        seen: set[tuple] = set()
        for i, r in enumerate(results):
            key = row_key(r)
            if key in seen:
                raise ReportSchemaError(f"{source}: results[{i}] repeats (domain, method, K, temperature) {key}")
            seen.add(key)
        skipped = []
        for i, s in enumerate(d["skipped"]):
            if not isinstance(s, dict) or not all(isinstance(s.get(k), str) for k in ("domain", "method", "reason")):
                raise ReportSchemaError(f"{source}: skipped[{i}] needs string fields domain, method, reason")
            skipped.append(SkippedEntry(s["domain"], s["method"], s["reason"]))
        return cls(TargetInfo(target["path"], target["fingerprint"]), d["config"], results, skipped,
                   d["recommendations"], d["created"], version)


def row_key(row: ResultRow) -> tuple[str, str, int, float]:
    """The identity of a result across reports (what `compare` matches on)."""
    return (row.domain, row.method, row.K, float(row.temperature))


_OPTIONAL_FLOATS = ("alpha", "tau", "speedup", "predicted_speedup", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99",
                    "draft_time_share", "target_time_share")
_UNIT_INTERVAL = ("alpha", "draft_time_share", "target_time_share")


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _row_from_dict(r: Any, where: str) -> ResultRow:
    if not isinstance(r, dict):
        raise ReportSchemaError(f"{where}: expected an object")
    names = {f.name for f in fields(ResultRow)}
    missing = sorted(n for n in names - {"ms_per_token_samples"} if n not in r)
    if missing:
        raise ReportSchemaError(f"{where}: missing field(s) {', '.join(missing)}")
    for key in ("domain", "method"):
        if not isinstance(r[key], str) or not r[key]:
            raise ReportSchemaError(f"{where}.{key} must be a non-empty string")
    for key in ("K", "repetitions"):
        if not isinstance(r[key], int) or isinstance(r[key], bool) or r[key] < 0:
            raise ReportSchemaError(f"{where}.{key} must be an integer >= 0, got {r[key]!r}")
    for key in ("temperature", "ms_per_token", "tokens_per_s", "spread"):
        if not _is_number(r[key]) or r[key] < 0:
            raise ReportSchemaError(f"{where}.{key} must be a finite number >= 0, got {r[key]!r}")
    for key in _OPTIONAL_FLOATS:
        if r[key] is not None and (not _is_number(r[key]) or r[key] < 0):
            raise ReportSchemaError(f"{where}.{key} must be null or a finite number >= 0, got {r[key]!r}")
    for key in _UNIT_INTERVAL:
        if r[key] is not None and r[key] > 1:
            raise ReportSchemaError(f"{where}.{key} must be in [0, 1], got {r[key]!r}")
    for key in ("a_k", "ms_per_token_samples"):
        values = r.get(key, [])
        if not isinstance(values, list) or not all(_is_number(v) and v >= 0 for v in values):
            raise ReportSchemaError(f"{where}.{key} must be a list of finite numbers >= 0")
    if any(v > 1 for v in r["a_k"]):
        raise ReportSchemaError(f"{where}.a_k values must be in [0, 1]")
    return ResultRow(**{n: r[n] for n in names if n in r})


def load_report(path: str | Path) -> Report:
    path = Path(path)
    if path.is_dir():
        path = path / "report.json"
    if not path.is_file():
        raise ReportSchemaError(f"no report at {path}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ReportSchemaError(f"{path}: not valid JSON ({e})") from e
    return Report.from_dict(data, source=str(path))


def atomic_write_text(path: Path, text: str) -> None:
    """Write via a temp file in the same directory + rename, so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ----------------------------------------------------------------------------- markdown

def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


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
    header = ["method", "K", "T", "alpha", "tau", "ms/token", "± std", "tok/s", "speed-up", "predicted",
              "TTFT p50/p99 ms", "ITL p50/p99 ms", "draft/target share", "reps"]
    for domain in domains:
        rows = sorted((r for r in report.results if r.domain == domain),
                      key=lambda r: (r.method != BASELINE_METHOD, r.method, r.K, r.temperature))
        lines += [f"## {domain}", ""]
        lines += _table(header, [[
            r.method, str(r.K), f"{r.temperature:g}", _fmt(r.alpha), _fmt(r.tau, ".2f"), f"{r.ms_per_token:.2f}",
            f"{r.spread:.2f}", f"{r.tokens_per_s:.1f}", _fmt(r.speedup, ".2f"), _fmt(r.predicted_speedup, ".2f"),
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
    lines += _recommendations_md(report.recommendations)
    if report.skipped:
        lines += ["## Skipped", ""]
        lines += _table(["domain", "method", "reason"], [[s.domain, s.method, s.reason] for s in report.skipped])
        lines.append("")
    if plot_files:
        lines += ["## Plots", ""]
        lines += [f"![{name}]({Path(p).name})" for name, p in plot_files.items()]
        lines.append("")
    return "\n".join(lines)


def _recommendations_md(recs: dict[str, Any]) -> list[str]:
    if not recs or not recs.get("domains"):
        return []
    thresholds = recs.get("thresholds", {})
    lines = ["## Recommendations", "",
             f"Speculation is disabled where alpha < {thresholds.get('min_alpha', '?')} or "
             f"speed-up < {thresholds.get('min_speedup', '?')}.", ""]
    entries = [("(default)", recs["default"])] if recs.get("default") else []
    entries += sorted(recs["domains"].items())
    lines += _table(["domain", "speculate", "method", "K", "alpha", "speed-up", "reason"], [[
        name, "yes" if e.get("speculate") else "no", str(e.get("method")), str(e.get("K")),
        _fmt(e.get("alpha")), _fmt(e.get("speedup"), ".2f"), str(e.get("reason", ""))] for name, e in entries])
    return lines + [""]


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
        from serve_eval.eval.plots import write_plots
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
        rec_cols = ["domain", "speculate", "method", "K", "alpha", "speedup", "reason"]
        payload["eval/recommendations"] = wandb.Table(
            columns=rec_cols, data=[[name] + [e.get(c) for c in rec_cols[1:]] for name, e in sorted(domains.items())])
    for name, path in (plot_files or {}).items():
        payload[f"eval/plots/{name}"] = wandb.Image(str(path))
    run.log(payload)
    return True
