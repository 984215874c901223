"""Intervals an eval can be trusted by: a paired percentile bootstrap over prompts.

A cell's figures are ratios of sums over its prompts (alpha = accepted / proposed draft tokens,
tau = emitted tokens / rounds), so a resample draws prompts with replacement and recomputes the
ratios from the same per-prompt sums. Its ms/token is the median over repetitions of each
repetition's decode time / decode tokens (one slow repetition must not move it), so the decode sums
are kept per repetition and a resample recomputes that same median: the interval is an interval of
the statistic the row reports, and contains it. A speed-up resamples
the *same* prompts for the method and for its baseline (paired): the prompt-to-prompt spread that
both share cancels, and what is left is the uncertainty of the comparison itself.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

CONFIDENCE = 0.95
NUM_RESAMPLES = 1000


@dataclass(frozen=True)
class PromptSums:
    """Per-prompt sums over a cell's repetitions, one entry per prompt (the same prompt order in every
    cell of a domain, so two cells can be paired)."""
    proposed: np.ndarray        # int [P] draft tokens proposed
    accepted: np.ndarray        # int [P] draft tokens accepted
    rounds: np.ndarray          # int [P] verification rounds
    decode_s: np.ndarray        # float [R, P] decode seconds (after each request's first token), per repetition
    decode_tokens: np.ndarray   # int [R, P] tokens generated after the first, per repetition

    @property
    def num_prompts(self) -> int:
        return self.decode_s.shape[-1]


@dataclass(frozen=True)
class Interval:
    low: float
    high: float

    def as_list(self) -> list[float]:
        return [self.low, self.high]


def resample_indices(num_prompts: int, seed: int, num_resamples: int = NUM_RESAMPLES) -> np.ndarray:
    """int [num_resamples, num_prompts]: prompt indices drawn with replacement."""
    return np.random.default_rng(seed).integers(0, num_prompts, size=(num_resamples, num_prompts))


def _interval(values: np.ndarray) -> Interval | None:
    finite = values[np.isfinite(values)]
    if finite.size < len(values) * 0.9:     # most resamples undefined (no rounds): no interval
        return None
    tail = (1 - CONFIDENCE) / 2 * 100
    low, high = np.percentile(finite, [tail, 100 - tail])
    return Interval(float(low), float(high))


def _ratio(numerator: np.ndarray, denominator: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """[N]: sum(numerator) / sum(denominator) over each resample's prompts (idx [N, P])."""
    num, den = numerator[..., idx].sum(axis=-1), denominator[..., idx].sum(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1), np.nan)


def median_ms_per_token(sums: PromptSums, idx: np.ndarray) -> np.ndarray:
    """[N]: the median over repetitions of each repetition's ms/token on each resample's prompts
    (repetitions that decoded nothing are left out, as the row's own median leaves them out)."""
    per_rep = 1000 * _ratio(sums.decode_s, sums.decode_tokens, idx)    # [R, N]
    with np.errstate(all="ignore"):
        finite = np.where(np.isfinite(per_rep), per_rep, np.nan)
        out = np.full(per_rep.shape[1], np.nan)
        defined = np.isfinite(finite).any(axis=0)
        out[defined] = np.nanmedian(finite[:, defined], axis=0)
    return out


def alpha_interval(sums: PromptSums, idx: np.ndarray) -> Interval | None:
    return _interval(_ratio(sums.accepted, sums.proposed, idx))


def tau_interval(sums: PromptSums, idx: np.ndarray) -> Interval | None:
    return _interval(1 + _ratio(sums.accepted, sums.rounds, idx))


def speedup_interval(method: PromptSums, baseline: PromptSums, idx: np.ndarray) -> Interval | None:
    """Baseline ms/token over the method's, each resample taking the same prompts for both."""
    if method.num_prompts != baseline.num_prompts:
        raise ValueError(f"paired bootstrap needs the same prompts: {method.num_prompts} vs {baseline.num_prompts}")
    base, mine = median_ms_per_token(baseline, idx), median_ms_per_token(method, idx)
    with np.errstate(divide="ignore", invalid="ignore"):
        return _interval(base / mine)
