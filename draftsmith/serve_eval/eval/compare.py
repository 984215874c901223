"""`draftsmith eval compare A B`: metric deltas (B - A) between two eval reports.

Rows are matched on (domain, method, K, temperature). The retrain hook uses `compare()` to see
whether a new target or draft moved alpha, tau, ms/token or speed-up.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.serve_eval.eval.report import Report, ReportSchemaError, load_report, row_key

METRICS = ("alpha", "tau", "ms_per_token", "speedup")
Key = tuple[str, str, int, float]


@dataclass
class MetricDelta:
    a: float | None
    b: float | None

    @property
    def delta(self) -> float | None:
        """B - A; None when either side has no value (e.g. alpha of no-spec)."""
        return None if self.a is None or self.b is None else self.b - self.a


@dataclass
class DeltaRow:
    domain: str
    method: str
    K: int
    temperature: float
    metrics: dict[str, MetricDelta]


@dataclass
class Comparison:
    rows: list[DeltaRow]
    only_in_a: list[Key] = field(default_factory=list)
    only_in_b: list[Key] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def get(self, domain: str, method: str, K: int, temperature: float) -> DeltaRow:
        for r in self.rows:
            if (r.domain, r.method, r.K, r.temperature) == (domain, method, K, float(temperature)):
                return r
        raise KeyError((domain, method, K, temperature))


def _as_report(x: Report | str | Path, label: str) -> Report:
    if isinstance(x, Report):
        return x
    try:
        return load_report(x)
    except ReportSchemaError as e:
        raise ReportSchemaError(f"report {label}: {e}") from e


def compare(report_a: Report | str | Path, report_b: Report | str | Path) -> Comparison:
    """Deltas B - A for every (domain, method, K, temperature) present in both reports."""
    a, b = _as_report(report_a, "A"), _as_report(report_b, "B")
    if a.schema_version != b.schema_version:
        raise ReportSchemaError(f"report A has schema_version {a.schema_version}, report B has "
                                f"{b.schema_version}; regenerate one so both use the same schema")
    rows_a = {row_key(r): r for r in a.results}
    rows_b = {row_key(r): r for r in b.results}
    shared = sorted(rows_a.keys() & rows_b.keys())
    rows = [DeltaRow(*key, {m: MetricDelta(getattr(rows_a[key], m), getattr(rows_b[key], m)) for m in METRICS})
            for key in shared]
    notes = []
    if a.target.fingerprint != b.target.fingerprint:
        notes.append(f"targets differ: A {a.target.fingerprint} vs B {b.target.fingerprint}")
    return Comparison(rows, sorted(rows_a.keys() - rows_b.keys()), sorted(rows_b.keys() - rows_a.keys()), notes)


def _cell(d: MetricDelta, fmt: str) -> str:
    if d.a is None and d.b is None:
        return "-"
    side = lambda v: "-" if v is None else format(v, fmt)  # noqa: E731
    if d.delta is None:
        return f"{side(d.a)} -> {side(d.b)}"
    return f"{side(d.a)} -> {side(d.b)} ({d.delta:+{fmt}})"


def print_comparison(cmp: Comparison, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title="eval compare: A -> B (delta = B - A)")
    for col in ("domain", "method", "K", "T", *METRICS):
        table.add_column(col, justify="left" if col in ("domain", "method") else "right")
    fmts = {"alpha": ".3f", "tau": ".2f", "ms_per_token": ".2f", "speedup": ".2f"}
    for r in cmp.rows:
        table.add_row(r.domain, r.method, str(r.K), f"{r.temperature:g}",
                      *(_cell(r.metrics[m], fmts[m]) for m in METRICS))
    console.print(table)
    for label, keys in (("only in A", cmp.only_in_a), ("only in B", cmp.only_in_b)):
        for k in keys:
            console.print(f"{label}: domain={k[0]} method={k[1]} K={k[2]} T={k[3]:g}")
    for note in cmp.notes:
        console.print(f"note: {note}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="draftsmith eval compare",
                                description="Print alpha, tau, ms/token and speed-up deltas (B - A) between "
                                            "two eval reports (report.json files or their directories).")
    p.add_argument("report_a", type=Path)
    p.add_argument("report_b", type=Path)
    args = p.parse_args(argv)
    try:
        cmp = compare(args.report_a, args.report_b)
    except ReportSchemaError as e:
        print(f"draftsmith eval compare: error: {e}", file=sys.stderr)
        return 2
    print_comparison(cmp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
