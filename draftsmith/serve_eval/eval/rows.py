"""Report rows from a cell's repetitions: median ms/token, spec counters, time shares, draft cost.

Every figure comes from serve_eval.speculative.metrics; serve_eval.eval.harness measures the cells and
serve_eval.eval.intervals adds their bootstrap intervals.
"""
from __future__ import annotations

import math
import statistics

from draftsmith.serve_eval.eval.report import BASELINE_METHOD, ResultRow
from draftsmith.serve_eval.eval.runners import RunResult
from draftsmith.serve_eval.speculative import metrics as M


def _finite_or_none(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else x


def run_ms_per_token(run: RunResult) -> float:
    """Decode ms/token of one repetition: each request's first token is prefill (TTFT), the other
    n - 1 are decode; decode times and tokens are summed over requests (= wall / tokens at batch 1)."""
    decode_s = sum(r.token_times[-1] - r.token_times[0] for r in run.records if r.num_output_tokens > 1)
    decode_tokens = sum(r.num_output_tokens - 1 for r in run.records if r.num_output_tokens > 1)
    return M.ms_per_token(decode_s, decode_tokens)


# Below this distinct-4-gram share the outputs are loops: a draft predicts a loop perfectly, so the cell's
# acceptance and speed-up say what drafts buy on the loop, not on text.
LOOP_SHARE = 0.3
NGRAM = 4


def distinct_ngram_share(runs: list[RunResult], n: int = NGRAM) -> float | None:
    """Mean over outputs of distinct n-grams / n-grams (1.0 = no n-gram repeats); None without token ids."""
    shares = []
    for run in runs:
        for record in run.records:
            ids = record.output_token_ids
            grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
            if grams:
                shares.append(len(set(grams)) / len(grams))
    return statistics.fmean(shares) if shares else None


def looping_cells(rows: list[ResultRow]) -> list[str]:
    """One line per baseline cell whose outputs loop (distinct 4-gram share below LOOP_SHARE)."""
    return [f"loop: {r.domain} T={r.temperature:g}: the target's answers repeat (distinct {NGRAM}-grams "
            f"{r.distinct_4gram_share:.2f} of all, below {LOOP_SHARE}); every draft there predicts the loop, so its "
            f"acceptance and speed-up overstate what it buys on non-repeating text (an undertrained target?)"
            for r in rows if r.method == BASELINE_METHOD and r.distinct_4gram_share is not None
            and r.distinct_4gram_share < LOOP_SHARE]


def spec_stats(runs: list[RunResult]) -> M.SpecStats | None:
    """Counters of every request's rounds; times from the run-level accounting (None when no round)."""
    parts = [r.spec for run in runs for r in run.records if r.spec is not None]
    parts += [run.spec_totals for run in runs if run.spec_totals is not None]
    if not parts:
        return None
    stats = M.SpecStats.merged(parts)
    if all(run.draft_time_s is not None and run.target_time_s is not None for run in runs):
        stats.draft_time_s = sum(run.draft_time_s for run in runs)
        stats.target_time_s = sum(run.target_time_s for run in runs)
    elif not (stats.draft_time_s or stats.target_time_s):
        stats.draft_time_s = stats.target_time_s = 0.0
    return stats


def _share(part: list[float | None], whole: list[float | None]) -> float | None:
    if any(p is None for p in part) or any(w is None for w in whole) or not sum(whole):
        return None
    return min(max(sum(part) / sum(whole), 0.0), 1.0)


def build_row(domain: str, method: str, K: int, temperature: float, runs: list[RunResult],
              baseline_ms_per_token: float | None) -> ResultRow:
    """One report row from the repetitions of a cell (warm-up excluded)."""
    if not runs:
        raise ValueError(f"({domain}, {method}, K={K}, T={temperature}): no repetitions to summarize")
    samples = [run_ms_per_token(run) for run in runs]
    finite = [s for s in samples if math.isfinite(s)]
    if not finite:
        raise ValueError(f"({domain}, {method}, K={K}, T={temperature}): no request generated more than one token")
    ms = statistics.median(finite)   # one slow repetition (another job) must not move the figure
    tokens = sum(r.num_output_tokens for run in runs for r in run.records)
    wall = sum(run.wall_s for run in runs)
    ttfts = [r.ttft for run in runs for r in run.records if r.ttft is not None]
    itls = [b - a for run in runs for r in run.records for a, b in zip(r.token_times, r.token_times[1:])]
    stats = spec_stats(runs) if K > 0 else None
    alpha = tau = predicted = None
    a_k: list[float] = []
    if stats is not None and stats.num_rounds:
        alpha, tau = _finite_or_none(stats.alpha), _finite_or_none(stats.tau)
        for a in stats.acceptance_by_position:  # nan = position never proposed (only past the last one)
            if not math.isfinite(a):
                break
            a_k.append(a)
        predicted = _finite_or_none(stats.predicted_speedup())
    draft_ms, cost = draft_cost(stats, K, baseline_ms_per_token if method != BASELINE_METHOD else None)
    busy = [run.busy_time_s for run in runs]
    draft_share = 0.0 if K == 0 and all(b is not None for b in busy) else _share([r.draft_time_s for r in runs], busy)
    speed = None
    if method == BASELINE_METHOD:
        baseline_ms_per_token = ms
    if baseline_ms_per_token is not None and math.isfinite(baseline_ms_per_token):
        speed = _finite_or_none(M.speedup(baseline_ms_per_token, ms))
    return ResultRow(
        domain=domain, method=method, K=K, temperature=float(temperature), alpha=alpha, tau=tau, a_k=a_k,
        ms_per_token=ms, tokens_per_s=tokens / wall if wall > 0 else 0.0, speedup=speed, predicted_speedup=predicted,
        ttft_p50=_finite_or_none(M.percentile(ttfts, 50)), ttft_p99=_finite_or_none(M.percentile(ttfts, 99)),
        itl_p50=_finite_or_none(M.percentile(itls, 50)), itl_p99=_finite_or_none(M.percentile(itls, 99)),
        draft_time_share=draft_share, target_time_share=_share([r.target_time_s for r in runs], busy),
        repetitions=len(runs), spread=statistics.stdev(finite) if len(finite) > 1 else 0.0,
        ms_per_token_samples=finite, draft_ms_per_round=draft_ms, cost_ratio=cost,
        distinct_4gram_share=distinct_ngram_share(runs))


def draft_cost(stats: M.SpecStats | None, K: int, baseline_ms_per_token: float | None) -> tuple[float | None, float | None]:
    """(draft ms per round, c = that / (K x plain ms per token)); None where no draft time was measured.
    At batch 1 a plain decode step emits one token, so its ms/token is the plain step's ms."""
    if stats is None or not stats.num_rounds or not stats.draft_time_s:
        return None, None
    per_round = 1000 * stats.draft_time_s / stats.num_rounds
    if baseline_ms_per_token is None or not math.isfinite(baseline_ms_per_token) or baseline_ms_per_token <= 0:
        return per_round, None
    return per_round, per_round / (K * baseline_ms_per_token)
