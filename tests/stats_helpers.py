"""Goodness-of-fit statistics shared by the sampling-exactness tests (verifier level and engine level).

Pearson chi-square of observed counts against an exact distribution, and its power against the worst
total-variation alternative:

- cells of zero probability must receive zero samples (a sample there is a bug on its own, whatever the
  p-value); they are left out of the test;
- cells of expected count < 5 are pooled into one bin (the chi-square approximation needs it);
- power: for any alternative Q at total-variation distance delta from P, the Pearson noncentrality
  N * sum (q - p)^2 / p is >= N * 4 * delta^2 (Cauchy-Schwarz on the positive and the negative part of
  q - p, each of mass delta; equality when each part is proportional to p on half of P's mass, so the
  bound is the worst case). Pooling can hide at most the pooled mass, so delta_eff = delta - pooled mass,
  and power = P(ncx2(df, N * 4 * delta_eff^2) > chi2.ppf(1 - alpha, df)) (asymptotic).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.stats import chi2, chisquare, ncx2


@dataclass(frozen=True)
class FitResult:
    p_value: float
    df: int  # degrees of freedom after pooling
    power: float  # against the worst alternative at the requested total-variation distance
    pooled_mass: float  # target probability of the pooled (expected count < 5) cells


def worst_case_power(num_samples: int, df: int, alpha: float, tv: float) -> float:
    """Power of the level-alpha Pearson test with df degrees of freedom against any TV-tv alternative."""
    if tv <= 0 or df <= 0:
        return 0.0
    return float(ncx2.sf(chi2.ppf(1 - alpha, df), df, num_samples * 4 * tv**2))


def chi_square_fit(counts, probs, alpha: float, tv: float) -> FitResult:
    """Pearson test of counts [C] against the exact cell probabilities probs [C] (same order).

    AssertionError when a zero-probability cell was sampled."""
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    if counts.shape != probs.shape:
        raise ValueError(f"counts shape {counts.shape} != probs shape {probs.shape}")
    num_samples = counts.sum()
    impossible = probs <= 0
    assert counts[impossible].sum() == 0, (
        f"{int(counts[impossible].sum())} samples fell on zero-probability cells "
        f"{np.flatnonzero(impossible & (counts > 0)).tolist()}")
    expected = probs * num_samples
    small = (expected < 5) & ~impossible
    big = ~small & ~impossible
    obs_bins, exp_bins = counts[big], expected[big]
    if small.any():
        obs_bins = np.append(obs_bins, counts[small].sum())
        exp_bins = np.append(exp_bins, expected[small].sum())
    df = obs_bins.size - 1
    pooled_mass = float(probs[small].sum())
    power = worst_case_power(int(num_samples), df, alpha, tv - pooled_mass)
    if df == 0:  # a single possible bin: nothing to test beyond the support check
        return FitResult(1.0, 0, power, pooled_mass)
    p_value = float(chisquare(obs_bins, exp_bins * obs_bins.sum() / exp_bins.sum()).pvalue)
    return FitResult(p_value, df, power, pooled_mass)


def worst_case_perturbation(probs, tv: float) -> np.ndarray:
    """The alternative the power bound is tight for: +tv spread in proportion to p over the likeliest cells
    holding about half the mass, -tv likewise over the rest (support unchanged; needs tv < each half's mass)."""
    probs = np.asarray(probs, dtype=np.float64)
    flat = probs.ravel()
    order = np.argsort(-flat, kind="stable")
    cum = np.cumsum(flat[order])
    up = np.zeros(flat.size, dtype=bool)
    up[order[: int(np.searchsorted(cum, 0.5)) + 1]] = True
    up_mass, down_mass = flat[up].sum(), flat[~up].sum()
    if not (tv < up_mass and tv < down_mass):
        raise ValueError(f"tv {tv} is not below both halves' mass ({up_mass:.3f}, {down_mass:.3f})")
    out = np.where(up, flat * (1 + tv / up_mass), flat * (1 - tv / down_mass))
    return out.reshape(probs.shape)


def total_variation(p, q) -> float:
    return 0.5 * float(np.abs(np.asarray(p, dtype=np.float64) - np.asarray(q, dtype=np.float64)).sum())
