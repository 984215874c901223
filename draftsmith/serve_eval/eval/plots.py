"""PNG plots of an eval run: speed-up by domain and method, a_k curves, alpha vs K, ms/token spread.

Uses matplotlib's object API with the Agg canvas (no pyplot, no global backend switch), so it
works headless and does not disturb a caller's own matplotlib state.
"""
from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from draftsmith.serve_eval.eval.report import BASELINE_METHOD, ResultRow
from draftsmith.serve_eval.eval.variants import variant_comparisons


def _grid(n: int, width: float = 4.5, height: float = 3.4) -> tuple[Figure, list]:
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig = Figure(figsize=(width * cols, height * rows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False).ravel().tolist()
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, axes[:n]


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=100)
    return path


def _error_bars(points: list[tuple[float, list[float] | None]]) -> list[list[float]] | None:
    """matplotlib's asymmetric yerr [[below...], [above...]] from 95% intervals (None: no interval)."""
    if not any(ci for _, ci in points):
        return None
    below = [max(value - ci[0], 0.0) if ci else 0.0 for value, ci in points]
    above = [max(ci[1] - value, 0.0) if ci else 0.0 for value, ci in points]
    return [below, above]


def _label(r: ResultRow) -> str:
    return r.method if r.method == BASELINE_METHOD else f"{r.method} K={r.K}"


def plot_speedup(results: list[ResultRow], path: Path) -> Path | None:
    """Grouped bars per domain: measured speed-up of each method/K with its 95% interval over prompts;
    dots: the seed formula's prediction."""
    rows = [r for r in results if r.method != BASELINE_METHOD and r.speedup is not None]
    if not rows:
        return None
    temps = sorted({r.temperature for r in rows})
    domains = sorted({r.domain for r in rows})
    labels = sorted({_label(r) for r in rows})
    fig, axes = _grid(len(temps), width=max(4.5, 1.2 * len(domains) + 2))
    width = 0.8 / len(labels)
    for ax, temp in zip(axes, temps):
        cell = {(r.domain, _label(r)): r for r in rows if r.temperature == temp}
        for j, label in enumerate(labels):
            present = [(i + (j - (len(labels) - 1) / 2) * width, cell[(d, label)])
                       for i, d in enumerate(domains) if (d, label) in cell]
            if not present:  # this method/K was not run at this temperature
                continue
            bars = ax.bar([x for x, _ in present], [r.speedup for _, r in present], width, label=label,
                          yerr=_error_bars([(r.speedup, r.speedup_ci) for _, r in present]), capsize=2)
            predicted = [(x, r.predicted_speedup) for x, r in present if r.predicted_speedup is not None]
            if predicted:
                ax.plot([x for x, _ in predicted], [p for _, p in predicted], "o", mfc="none",
                        color=bars.patches[0].get_facecolor(), ms=5)
        ax.axhline(1.0, color="black", lw=0.8, ls="--")
        ax.set_xticks(range(len(domains)), domains)
        ax.set_ylabel("speed-up vs no-spec")
        ax.set_title(f"T={temp:g} (bars measured, circles predicted)")
    axes[0].legend(fontsize="small")
    return _save(fig, path)


def plot_acceptance_curves(results: list[ResultRow], path: Path) -> Path | None:
    """Per-position acceptance a_k vs k, one panel per domain."""
    rows = [r for r in results if r.a_k]
    if not rows:
        return None
    domains = sorted({r.domain for r in rows})
    fig, axes = _grid(len(domains))
    for ax, domain in zip(axes, domains):
        for r in sorted((r for r in rows if r.domain == domain), key=lambda r: (r.method, r.K, r.temperature)):
            ax.plot(range(1, len(r.a_k) + 1), r.a_k, marker="o", label=f"{_label(r)} T={r.temperature:g}")
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("draft position k")
        ax.set_ylabel("a_k")
        ax.set_title(domain)
        ax.legend(fontsize="x-small")
    return _save(fig, path)


def plot_alpha_vs_k(results: list[ResultRow], path: Path) -> Path | None:
    """Acceptance rate alpha against lookahead K, one line per method and temperature, panel per domain."""
    rows = [r for r in results if r.alpha is not None and r.K > 0]
    if not rows:
        return None
    domains = sorted({r.domain for r in rows})
    fig, axes = _grid(len(domains))
    for ax, domain in zip(axes, domains):
        lines: dict[tuple[str, float], list[tuple[int, float]]] = defaultdict(list)
        for r in rows:
            if r.domain == domain:
                lines[(r.method, r.temperature)].append((r.K, r.alpha, r.alpha_ci))
        for (method, temp), pts in sorted(lines.items()):
            pts.sort(key=lambda p: p[0])
            ax.errorbar([k for k, _, _ in pts], [a for _, a, _ in pts], marker="o", capsize=2,
                        yerr=_error_bars([(a, ci) for _, a, ci in pts]), label=f"{method} T={temp:g}")
        ax.axhline(0.5, color="red", lw=0.8, ls=":")
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("K")
        ax.set_ylabel("alpha")
        ax.set_title(domain)
        ax.legend(fontsize="x-small")
    return _save(fig, path)


def plot_ms_per_token(results: list[ResultRow], path: Path) -> Path | None:
    """ms/token distribution over repetitions (box per method; mean ± std where samples are absent)."""
    if not results:
        return None
    domains = sorted({r.domain for r in results})
    fig, axes = _grid(len(domains))
    for ax, domain in zip(axes, domains):
        rows = sorted((r for r in results if r.domain == domain),
                      key=lambda r: (r.method != BASELINE_METHOD, r.method, r.K, r.temperature))
        labels = [f"{_label(r)}\nT={r.temperature:g}" for r in rows]
        for i, r in enumerate(rows, start=1):
            if r.ms_per_token_samples:
                ax.boxplot([r.ms_per_token_samples], positions=[i], widths=0.6)
            else:
                ax.errorbar([i], [r.ms_per_token], yerr=[r.spread], fmt="o", capsize=4)
        ax.set_xticks(range(1, len(rows) + 1), labels, fontsize="x-small", rotation=45)
        ax.set_ylabel("ms/token")
        ax.set_title(domain)
    return _save(fig, path)


def plot_variants(results: list[ResultRow], path: Path) -> Path | None:
    """Quantized variants beside their source draft, per temperature: draft ms per round (left) and alpha
    with its 95% interval (right), grouped by domain (serve_eval.eval.variants)."""
    comparisons = variant_comparisons(results)
    if not comparisons:
        return None
    temps = sorted({c.temperature for c in comparisons})
    domains = sorted({c.domain for c in comparisons})
    fig, axes = _grid(2 * len(temps), width=max(4.5, 1.2 * len(domains) + 2))
    for i, temp in enumerate(temps):
        rows = {(r.domain, r.method): r for c in comparisons if c.temperature == temp for r in (c.source, c.variant)}
        labels = sorted({m for _, m in rows})
        width = 0.8 / len(labels)
        for ax, field, ylabel in ((axes[2 * i], "draft_ms_per_round", "draft ms / round"),
                                  (axes[2 * i + 1], "alpha", "alpha")):
            for j, label in enumerate(labels):
                present = [(k + (j - (len(labels) - 1) / 2) * width, rows[(d, label)]) for k, d in enumerate(domains)
                           if (d, label) in rows and getattr(rows[(d, label)], field) is not None]
                if not present:
                    continue
                errors = _error_bars([(r.alpha, r.alpha_ci) for _, r in present]) if field == "alpha" else None
                ax.bar([x for x, _ in present], [getattr(r, field) for _, r in present], width, label=label,
                       yerr=errors, capsize=2)
            ax.set_xticks(range(len(domains)), domains)
            ax.set_ylabel(ylabel)
            ax.set_title(f"T={temp:g}: {ylabel}")
        axes[2 * i].legend(fontsize="x-small")
    return _save(fig, path)


PLOTS = {
    "speedup": plot_speedup,
    "acceptance_curves": plot_acceptance_curves,
    "alpha_vs_k": plot_alpha_vs_k,
    "ms_per_token": plot_ms_per_token,
    "variants": plot_variants,
}


def write_plots(results: list[ResultRow], out_dir: str | Path) -> dict[str, Path]:
    """Write every plot that has data to `out_dir/<name>.png`; returns {name: path} of those written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, plot in PLOTS.items():
        path = plot(results, out_dir / f"{name}.png")
        if path is not None:
            written[name] = path
    return written
