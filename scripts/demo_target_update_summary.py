"""The retrain-hook demonstration's figures: the before/after table with 95% intervals, and the mean over seeds.

Every alpha of the table is an eval report's, and so is its interval: the harness's paired percentile
bootstrap over prompts (serve_eval.eval.bootstrap), 95%, per (domain, method) cell.

The share of the lost alpha recovered combines three cells per regressed domain (old draft on the old
target, old draft on the new target, hook candidate on the new target). Reports keep each cell's
interval but not its per-prompt sums, so its interval is propagated from the cells': each cell's alpha
is drawn from a normal with the width of its bootstrap interval, independently. The cells share their
prompts (positively correlated), so treating them as independent overstates the spread: the interval
is conservative, and the table says it is approximate.
"""

from __future__ import annotations

import math
from pathlib import Path
from statistics import mean
from typing import Any

import numpy as np

_Z95 = 1.959964
_DRAWS = 4000


def report_cells(report_path: str | Path | None, method: str) -> dict[str, tuple[float, list[float] | None]]:
    """domain -> (alpha, 95% interval or None) of ``method`` in an eval report; a domain measured at
    several (K, T) points gets their mean alpha and no interval (intervals do not average)."""
    from draftsmith.serve_eval.eval.report import load_report

    if not report_path or not Path(report_path).is_file():
        return {}
    rows: dict[str, list] = {}
    for r in load_report(report_path).results:
        if r.method == method and r.alpha is not None:
            rows.setdefault(r.domain, []).append(r)
    return {d: (rs[0].alpha, rs[0].alpha_ci) if len(rs) == 1 else (mean(r.alpha for r in rs), None)
            for d, rs in rows.items()}


def recovered_share(old: float | None, dropped: float | None, candidate: float | None) -> float | None:
    """Share of the alpha lost by the update that the re-distilled draft won back (None: nothing was lost)."""
    if old is None or dropped is None or candidate is None or old - dropped <= 0:
        return None
    return (candidate - dropped) / (old - dropped)


def _draws(alpha: float, ci: list[float] | None, rng: np.random.Generator) -> np.ndarray:
    sd = 0.0 if not ci else (ci[1] - ci[0]) / (2 * _Z95)
    return rng.normal(alpha, sd, _DRAWS)


def share_interval(cells: list[tuple[tuple, tuple, tuple]], seed: int = 0) -> list[float] | None:
    """95% interval of sum(cand - new) / sum(old - new) over regressed domains, each cell a (alpha, ci)
    (None when a cell has no interval)."""
    if not cells or any(c[1] is None for triple in cells for c in triple):
        return None
    rng = np.random.default_rng(seed)
    lost = np.zeros(_DRAWS)
    won = np.zeros(_DRAWS)
    for old, new, cand in cells:
        o, n, c = (_draws(*cell, rng) for cell in (old, new, cand))
        lost += o - n
        won += c - n
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.where(lost > 0, won / np.where(lost > 0, lost, 1), np.nan)
    share = share[np.isfinite(share)]
    if share.size < _DRAWS * 0.9:
        return None
    low, high = np.percentile(share, [2.5, 97.5])
    return [float(low), float(high)]


def summarize(record: dict, scratch: dict | None, threshold: float,
              reports: dict[str, dict[str, str | None]] | None = None) -> dict[str, Any]:
    """Rows per (kind, domain) with each cell's alpha and interval; ``reports`` = kind -> {"old": old
    draft's report on the old target, "scratch": the from-scratch draft's}; the record names the rest."""
    rows, lost, won, cells = [], 0.0, 0.0, []
    for d in record.get("drafts", []):
        kind, paths = d["kind"], (reports or {}).get(d["kind"], {})
        cand_report = (d.get("candidate") or {}).get("report")
        ci = {name: report_cells(path, kind) for name, path in (
            ("old", paths.get("old")), ("new", d.get("report_new_target")), ("cand", cand_report),
            ("scratch", paths.get("scratch")))}
        for domain, v in sorted(d["domains"].items()):
            cand = v.get("candidate")
            share = recovered_share(v.get("old_target"), v.get("new_target"), cand)
            regressed = share is not None and v["old_target"] - v["new_target"] > threshold + 1e-9
            if regressed:
                lost += v["old_target"] - v["new_target"]
                won += cand - v["new_target"]
                cells.append(tuple((x, ci[name].get(domain, (None, None))[1]) for name, x in
                                   (("old", v["old_target"]), ("new", v["new_target"]), ("cand", cand))))
            rows.append({"kind": kind, "domain": domain, "old_draft_old_target": v.get("old_target"),
                         "old_draft_new_target": v.get("new_target"), "redistilled_new_target": cand,
                         "scratch_new_target": (scratch or {}).get("alphas", {}).get(kind, {}).get(domain),
                         "recovered": share, "regressed": domain in d.get("regressed", []),
                         "ci": {name: ci[name].get(domain, (None, None))[1] for name in ci}})
    return {"rows": rows, "recovered_regressed": won / lost if lost > 0 else None,
            "recovered_regressed_ci": share_interval(cells) if lost > 0 else None}


def _with_ci(x: float | None, ci: list[float] | None) -> str:
    if x is None:
        return "-"
    return f"{x:.3f}" if not ci else f"{x:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]"


def _pct(x: float | None, ci: list[float] | None = None) -> str:
    if x is None:
        return "-"
    return f"{x:.0%}" if not ci else f"{x:.0%} [{ci[0]:.0%}, {ci[1]:.0%}]"


def render(summary: dict[str, Any]) -> str:
    lines = ["| draft | domain | old draft, old target | old draft, new target | re-distilled (hook), new target "
             "| from scratch, new target | lost alpha recovered |", "|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        ci = r.get("ci", {})
        lines.append(f"| {r['kind']} | {r['domain']}{' *' if r['regressed'] else ''} | "
                     f"{_with_ci(r['old_draft_old_target'], ci.get('old'))} | "
                     f"{_with_ci(r['old_draft_new_target'], ci.get('new'))} | "
                     f"{_with_ci(r['redistilled_new_target'], ci.get('cand'))} | "
                     f"{_with_ci(r['scratch_new_target'], ci.get('scratch'))} | {_pct(r['recovered'])} |")
    s = summary
    lines += ["", f"Alphas: {s.get('eval_prompts', '?')} held-out prompts x {s.get('eval_tokens', '?')} tokens per "
                  f"domain, seed {s.get('seed', 0)}; [low, high] = 95% bootstrap interval over prompts."]
    up = s.get("target_update") or {}
    if up.get("finetune"):
        ppl = " ".join(f"{d} {up['perplexity_before'][d]:.1f}->{up['perplexity_after'][d]:.1f}"
                       for d in sorted(up.get("perplexity_after") or {}))
        lines.append(f"Target update: {s['old_fingerprint']} -> {s['new_fingerprint']}, fine-tuned on "
                     f"{up['finetune']['domain']} for {up['steps']} steps (lr {up['finetune']['lr']:g}, "
                     f"{up['train_wall_s']:.0f} s); held-out perplexity {ppl or '-'}.")
    lines.append(f"`*` regressed (alpha fell by more than {s['threshold']:g}). Lost alpha recovered on the regressed "
                 f"domains: {_pct(s['recovered_regressed'], s.get('recovered_regressed_ci'))} "
                 "(interval approximate, from the cells' intervals; goal >= 90%).")
    t = s["hook_timings_s"]
    lines.append(f"Hook: exit {s['hook_exit']} ({s['hook_outcome']}), wall {s['hook_wall_s']:.0f} s (evaluate old "
                 f"drafts {t.get('evaluate_old_drafts', 0):.0f} s, regenerate {t.get('regenerate', 0):.0f} s, distill "
                 f"{t.get('distill', 0):.0f} s warm-started for {s['hook_steps']} steps, evaluate candidates "
                 f"{t.get('evaluate_candidates', 0):.0f} s); data plan {s['data_plan']}.")
    if s.get("scratch"):
        sc = s["scratch"]
        ratio, bare = time_ratios(s)
        lines.append(f"From scratch, same kind(s), original recipe ({s['steps']} steps, all domains): "
                     f"{sc['wall_s']:.0f} s (regenerate {sc['regenerate_s']:.0f} s, distill {sc['distill_s']:.0f} s, "
                     f"evaluate {sc.get('evaluate_s', 0):.0f} s). Hook / from scratch = {ratio:.2f}, each through an "
                     f"evaluated draft (goal <= 0.50: {'met' if ratio <= 0.5 else 'not met'}); without any "
                     f"evaluation on either side {bare:.2f}.")
    return "\n".join(lines)


def time_ratios(s: dict[str, Any]) -> tuple[float, float]:
    """(hook / from-scratch wall time, each through an evaluated draft; the same without any evaluation:
    the hook's of the old drafts and of its candidates, the scratch draft's)."""
    sc, t = s["scratch"], s.get("hook_timings_s") or {}
    hook_evals = t.get("evaluate_old_drafts", 0) + t.get("evaluate_candidates", 0) + t.get("evaluate_reference", 0)
    scratch_eval = sc.get("evaluate_s", 0.0)
    return s["hook_wall_s"] / sc["wall_s"], (s["hook_wall_s"] - hook_evals) / (sc["wall_s"] - scratch_eval)


# ----------------------------------------------------------------------------- over seeds

def over_seeds(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean over seeds of every table cell, the recovered share and the time ratio, with each seed's value."""
    def avg(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None and math.isfinite(v)]
        return mean(present) if present else None

    keys = ("old_draft_old_target", "old_draft_new_target", "redistilled_new_target", "scratch_new_target")
    cells: dict[tuple[str, str], dict[str, list]] = {}
    for s in summaries:
        for r in s["rows"]:
            cell = cells.setdefault((r["kind"], r["domain"]), {k: [] for k in (*keys, "regressed")})
            for k in keys:
                cell[k].append(r[k])
            cell["regressed"].append(r["regressed"])
    ratios = [time_ratios(s)[0] if s.get("scratch") else None for s in summaries]
    bare = [time_ratios(s)[1] if s.get("scratch") else None for s in summaries]
    return {"seeds": [s.get("seed") for s in summaries],
            "rows": [{"kind": kind, "domain": domain, **{k: avg(v[k]) for k in keys},
                      "regressed_in": sum(v["regressed"])} for (kind, domain), v in sorted(cells.items())],
            "recovered_regressed": avg([s["recovered_regressed"] for s in summaries]),
            "recovered_by_seed": [s["recovered_regressed"] for s in summaries],
            "recovered_ci_by_seed": [s.get("recovered_regressed_ci") for s in summaries],
            "time_ratio": avg(ratios), "time_ratio_by_seed": ratios,
            "time_ratio_without_evals": avg(bare), "time_ratio_without_evals_by_seed": bare}


def render_over_seeds(agg: dict[str, Any]) -> str:
    f = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    n = len(agg["seeds"])
    lines = [f"Mean over {n} seeds ({', '.join(str(s) for s in agg['seeds'])}):", "",
             "| draft | domain | old draft, old target | old draft, new target | re-distilled (hook), new target "
             "| from scratch, new target | regressed in |", "|---|---|---|---|---|---|---|"]
    for r in agg["rows"]:
        lines.append(f"| {r['kind']} | {r['domain']} | {f(r['old_draft_old_target'])} | {f(r['old_draft_new_target'])} "
                     f"| {f(r['redistilled_new_target'])} | {f(r['scratch_new_target'])} | {r['regressed_in']}/{n} |")
    per_seed = "; ".join(f"seed {s}: {_pct(v, ci)}" for s, v, ci in
                         zip(agg["seeds"], agg["recovered_by_seed"], agg["recovered_ci_by_seed"]))
    ratios = ", ".join("-" if r is None else f"{r:.2f}" for r in agg["time_ratio_by_seed"])
    lines += ["", f"Lost alpha recovered on the regressed domains, mean over seeds: {_pct(agg['recovered_regressed'])} "
                  f"({per_seed}); goal >= 90%.",
              f"Hook / from scratch wall time, each through an evaluated draft, mean over seeds: "
              f"{f(agg['time_ratio'])} (per seed {ratios}); goal <= 0.50. Without any evaluation on either side: "
              f"{f(agg.get('time_ratio_without_evals'))}."]
    return "\n".join(lines)
