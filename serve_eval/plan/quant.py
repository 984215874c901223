"""What a quantized draft changes in `draftsmith plan`: the bytes per draft weight and the alpha it costs.

The alpha cost is measured when a figures file is given: the JSON that ``scripts/bench_quant.py --json`` writes
(per draft kind and variant, alpha per domain). cost[kind] = mean over domains of alpha(bf16) - alpha(variant),
for the variant of the planned dtype (int8, or int4 at any group size). Without one, the seed's figure is
assumed for INT4 (3-5 points: 4) and none for INT8, and the plan's notes say so.
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
    costs = {}
    for strategy, kinds in PLAN_KINDS.items():
        found = [by_kind[k] for k in kinds if k in by_kind]
        if found:
            costs[strategy] = max(0.0, sum(found) / len(found))
    return costs


def quantized_alphas(alpha: dict[str, float], dtype: str | None, figures: str | Path | None) -> tuple[dict[str, float], list[str]]:
    """(alpha per strategy after the quantization cost, notes). dtype None or a float dtype: unchanged."""
    if dtype not in QUANT_DTYPES:
        if figures:
            raise ValueError(f"--alpha-cost-from needs --draft-dtype in {list(QUANT_DTYPES)}, got {dtype!r}")
        return dict(alpha), []
    notes = []
    costs = measured_alpha_costs(figures, dtype) if figures else {}
    out = dict(alpha)
    for strategy in alpha:
        if strategy in costs:
            cost, how = costs[strategy], f"measured in {figures}"
        else:
            cost, how = ASSUMED_ALPHA_COST[dtype], "assumed (the seed's figure)" if dtype == "int4" else "assumed"
        out[strategy] = max(0.0, alpha[strategy] - cost)
        notes.append(f"{strategy}: {dtype} draft costs {cost * 100:.1f} alpha points, {how}")
    return out, notes
