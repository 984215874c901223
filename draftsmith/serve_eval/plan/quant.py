"""What a quantized draft changes in `draftsmith plan`: the bytes per draft weight and the alpha it costs.

The alpha cost is measured when figures are given, from either source:
- an eval report (``--report``: report.json or its dir) that ran quantized variants beside their source drafts
  (serve_eval.eval.variants): cost[kind] = mean over the report's (domain, T, K) cells of alpha(source) -
  alpha(variant), for the variants of the planned dtype;
- the JSON that ``scripts/bench_quant.py --json`` writes (``--alpha-cost-from``; per draft kind and variant,
  alpha per domain): cost[kind] = mean over domains of alpha(bf16) - alpha(variant).
int8 matches the int8 variant, int4 any group size. Without figures (or for a kind they do not cover) the
seed's figure is assumed for INT4 (3-5 points: 4) and none for INT8; the plan's notes say which was used.
"""

from __future__ import annotations

import json
from pathlib import Path

QUANT_DTYPES = ("int8", "int4")
ASSUMED_ALPHA_COST = {"int8": 0.0, "int4": 0.04}  # the seed: "INT4 costs a standalone draft 3-5 points"
# the plan's strategy names -> the draft kinds the figures file measures
PLAN_KINDS = {"standalone": ("standalone",), "eagle": ("eagle", "eagle3"), "medusa": ("medusa",)}


def _variant_matches(variant: str, dtype: str) -> bool:
    return variant == dtype or variant.startswith(f"{dtype}-")


def measured_alpha_costs(path: str | Path, dtype: str) -> dict[str, float]:
    """{plan strategy: alpha points lost at this dtype} from a bench_quant JSON file (ValueError naming it)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--alpha-cost-from: no file at {path}")
    try:
        acceptance = json.loads(path.read_text())["acceptance"]
    except (json.JSONDecodeError, KeyError) as err:
        raise ValueError(f"--alpha-cost-from: {path} is not a scripts/bench_quant.py --json file ({err})") from None
    by_kind: dict[str, float] = {}
    for name, domains in acceptance.items():
        kind, _, variant = name.partition("/")
        base = acceptance.get(f"{kind}/bf16")
        if not _variant_matches(variant, dtype) or not base:
            continue
        losses = [base[d][0] - alpha for d, (alpha, _tau) in domains.items() if d in base]
        if losses:
            by_kind[kind] = sum(losses) / len(losses)
    return _by_strategy(by_kind)


def _by_strategy(by_kind: dict[str, float]) -> dict[str, float]:
    costs = {}
    for strategy, kinds in PLAN_KINDS.items():
        found = [by_kind[k] for k in kinds if k in by_kind]
        if found:
            costs[strategy] = max(0.0, sum(found) / len(found))
    return costs


def report_alpha_costs(path: str | Path, dtype: str) -> dict[str, float]:
    """{plan strategy: alpha points lost at this dtype} from an eval report's variant rows (ValueError naming it)."""
    from draftsmith.serve_eval.eval.report import ReportSchemaError, load_report
    from draftsmith.serve_eval.eval.variants import variant_comparisons

    try:
        report = load_report(path)
    except ReportSchemaError as err:
        raise ValueError(f"--report: {err}") from None
    kinds = report.config.get("draft_kinds") or {}
    losses: dict[str, list[float]] = {}
    for c in variant_comparisons(report.results):
        if c.alpha_cost is not None and _variant_matches(c.variant.quantization or "", dtype):
            losses.setdefault(kinds.get(c.source.method, c.source.method), []).append(c.alpha_cost)
    return _by_strategy({kind: sum(v) / len(v) for kind, v in losses.items()})


def quantized_alphas(alpha: dict[str, float], dtype: str | None, figures: str | Path | None,
                     report: str | Path | None = None) -> tuple[dict[str, float], list[str]]:
    """(alpha per strategy after the quantization cost, notes). dtype None or a float dtype: unchanged.
    figures: a bench_quant JSON; report: an eval report with quantized variants (at most one of the two)."""
    given = [flag for flag, value in (("--alpha-cost-from", figures), ("--report", report)) if value]
    if dtype not in QUANT_DTYPES:
        if given:
            raise ValueError(f"{given[0]} needs --draft-dtype in {list(QUANT_DTYPES)}, got {dtype!r}")
        return dict(alpha), []
    if len(given) > 1:
        raise ValueError("--report and --alpha-cost-from: give one source of measured alpha costs, not both")
    notes = []
    if report:
        costs, source = report_alpha_costs(report, dtype), f"eval report {report}"
    else:
        costs, source = (measured_alpha_costs(figures, dtype) if figures else {}), str(figures)
    out = dict(alpha)
    for strategy in alpha:
        if strategy in costs:
            cost, how = costs[strategy], f"measured in {source}"
        else:
            cost, how = ASSUMED_ALPHA_COST[dtype], "assumed (the seed's figure)" if dtype == "int4" else "assumed"
            if given:
                how += f"; {source} measures no {dtype} variant of it"
        out[strategy] = max(0.0, alpha[strategy] - cost)
        notes.append(f"{strategy}: {dtype} draft costs {cost * 100:.1f} alpha points, {how}")
    return out, notes
