"""A report row's 95% intervals from the per-prompt records of its cell's repetitions.

serve_eval.eval.bootstrap does the resampling over per-prompt sums; this module gathers those sums
from the runners' records (prompt i is records[i] of every repetition) and fills the row's fields.
"""
from __future__ import annotations

import numpy as np

from draftsmith.serve_eval.eval import bootstrap as B
from draftsmith.serve_eval.eval.report import ResultRow
from draftsmith.serve_eval.eval.runners import RunResult


def prompt_sums(runs: list[RunResult]) -> B.PromptSums | None:
    """Per-prompt sums over repetitions, decode sums per repetition (None when repetitions disagree
    on the prompt count)."""
    counts = {len(run.records) for run in runs}
    if len(counts) != 1:
        return None
    size = counts.pop()
    proposed, accepted, rounds = np.zeros(size, np.int64), np.zeros(size, np.int64), np.zeros(size, np.int64)
    decode_s, decode_tokens = np.zeros((len(runs), size)), np.zeros((len(runs), size), np.int64)
    for rep, run in enumerate(runs):
        for i, record in enumerate(run.records):
            if record.spec is not None:
                proposed[i] += record.spec.num_proposed
                accepted[i] += record.spec.num_accepted
                rounds[i] += record.spec.num_rounds
            if record.num_output_tokens > 1:
                decode_s[rep, i] = record.token_times[-1] - record.token_times[0]
                decode_tokens[rep, i] = record.num_output_tokens - 1
    return B.PromptSums(proposed, accepted, rounds, decode_s, decode_tokens)


def add_intervals(row: ResultRow, runs: list[RunResult], baseline_runs: list[RunResult] | None, seed: int) -> None:
    """The row's 95% bootstrap intervals over prompts (alpha and tau from per-request counters, the
    speed-up paired with the baseline cell's same prompts)."""
    sums = prompt_sums(runs)
    if sums is None or sums.num_prompts < 2:
        return
    row.num_prompts = sums.num_prompts
    idx = B.resample_indices(sums.num_prompts, seed)
    if row.alpha is not None and sums.proposed.sum() > 0:
        row.alpha_ci = _as_list(B.alpha_interval(sums, idx))
        row.tau_ci = _as_list(B.tau_interval(sums, idx))
    base = prompt_sums(baseline_runs) if baseline_runs else None
    if row.speedup is not None and base is not None and base.num_prompts == sums.num_prompts:
        row.speedup_ci = _as_list(B.speedup_interval(sums, base, idx))


def _as_list(interval: B.Interval | None) -> list[float] | None:
    return None if interval is None else interval.as_list()
