"""Pipeline stage ``cost``: each draft's measured cost ratio c against the target, in our engine.

c = draft ms per round / (K x plain decode step ms), K = the largest K the eval sweeps, batch 1, T = 0
(serve_eval.eval.step_cost, the code scripts/bench_spec_round.py prints with). It decides how much
speculation can pay: with acceptance alpha and K drafts the speed-up is at most
(1 - alpha^(K+1)) / ((1 - alpha) (1 + K c)). The stage also reports each draft's weight share (draft
parameters read per token / target's). It runs on the eval's engine settings (device, dtype, attention backend,
block size), so c is measured where the eval serves. Cached by (target, draft dirs, K, steps, repetitions, those
settings) under the target's reports dir; ``pipeline.force=[cost]`` measures again.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from draftsmith.drafts.files import read_json, stable_hash, write_json
from draftsmith.train.pipeline.context import CostResult, PipelineContext, need

if TYPE_CHECKING:
    from draftsmith.serve_eval.schemas import EvalConfig


# How the cost is measured, in the cache key: a file measured another way is measured again. 2: every engine on one
# copy of the target's weights (step_cost.build_engines), where each had its own (c read on cold weights).
COST_METHOD = 2


def largest_eval_k(settings: EvalConfig) -> int:
    # The common K list's largest: every kind can draft it (a method's own larger K, e.g. a block draft's,
    # is costed per row by the eval itself).
    return max(settings.num_speculative_tokens, default=4) or 4


def stage_cost(ctx: PipelineContext) -> dict[str, Any]:
    from draftsmith.serve_eval.eval.step_cost import measure_costs, weights_read
    target, drafts = need(ctx.results.target, "target"), dict(ctx.results.drafts)
    if not drafts:
        raise ValueError("pipeline.stages: 'cost' needs at least one distill_<kind> stage before it")
    from draftsmith.train.pipeline.evaluate import check_eval_settings

    settings = check_eval_settings(ctx.cfg)
    # c is measured where and how the eval serves (its engine settings), at the eval's largest K.
    k, engine = largest_eval_k(settings), settings.engine
    where = {"device": engine.device, "dtype": engine.dtype, "attn_backend": engine.attn_backend,
             "block_size": engine.block_size}
    steps, repeats = ctx.cfg.pipeline.cost_steps, ctx.cfg.pipeline.cost_repeats
    key = stable_hash({"target": target.fingerprint, "drafts": {n: str(p) for n, p in drafts.items()},
                       "k": k, "steps": steps, "repeats": repeats, **where, "method": COST_METHOD})
    out = ctx.artifacts.reports_dir(target.fingerprint) / f"cost-{key}.json"
    cached = out.is_file() and not ctx.forced("cost")
    if not cached:
        costs = measure_costs(Path(target.model_dir), drafts, k, steps=steps, repeats=repeats, **where)
        target_weights = weights_read(Path(target.model_dir))
        write_json(out, {"k": k, "steps": steps, "repeats": repeats, "engine": where, "target_weights": target_weights,
                         "methods": [asdict(c) for c in costs],
                         "weight_share": {n: weights_read(p) / target_weights for n, p in drafts.items()}})
    record = read_json(out)
    c = {m["method"]: float(m["c"]) for m in record["methods"] if m["c"] is not None}
    ctx.results.cost = CostResult(out, c, cost_lines(record))  # the lines: printed with the target, in summary.md
    return {"cached": cached, "K": k, "file": out, **{f"c_{kind}": round(v, 3) for kind, v in c.items()}}


def cost_lines(record: dict[str, Any] | None) -> list[str]:
    """The printed (and summary.md) lines: per draft, c and its weight share; the plain step's ms."""
    if not record:
        return []
    plain = next((m for m in record["methods"] if m["c"] is None), None)
    engine = record.get("engine")  # absent from records written before it was stored
    where = f" ({engine['dtype']} on {engine['device']})" if engine else ""
    lines = [f"draft cost ratio c (draft ms per round / (K={record['k']} x plain step ms), our engine{where}, batch 1, "
             f"T=0, median of {record['repeats']} x {record['steps']} steps"
             + (f"; plain step {plain['ms']['step'][0]:.2f} ms" if plain else "") + "):"]
    for m in record["methods"]:
        if m["c"] is None:
            continue
        share = record["weight_share"][m["method"]]
        lines.append(f"  {m['method']:<11} c={m['c']:.3f}  draft {m['ms']['draft'][0]:.2f} ms/round  "
                     f"weights {share:.3f} of the target's")
    return lines
