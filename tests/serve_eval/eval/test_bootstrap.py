"""draftsmith.serve_eval.eval.bootstrap: the intervals cover the truth about 95% of the time on synthetic evals
whose true values are known, and pairing makes a speed-up interval tighter than the noise it shares."""
from __future__ import annotations

import numpy as np

from draftsmith.serve_eval.eval import bootstrap as B

PROMPTS, TOKENS, DRAWS, REPS = 12, 64, 300, 3


def synthetic_cell(rng: np.random.Generator, true_alpha: float, prompt_ms: np.ndarray, speed: float) -> B.PromptSums:
    """12 prompts of 64 draft tokens: each prompt has its own acceptance (Beta around true_alpha) and its
    own decode cost (shared by every method), then per-token noise."""
    p = rng.beta(true_alpha * 20, (1 - true_alpha) * 20, PROMPTS)
    accepted = rng.binomial(TOKENS, p)
    proposed = np.full(PROMPTS, TOKENS)
    rounds = np.full(PROMPTS, TOKENS // 4)
    decode_tokens = np.full((REPS, PROMPTS), TOKENS)
    decode_s = prompt_ms / speed * decode_tokens / 1000 * rng.normal(1.0, 0.03, (REPS, PROMPTS))
    return B.PromptSums(proposed, accepted, rounds, decode_s, decode_tokens)


def test_alpha_interval_covers_the_true_alpha_about_95_percent_of_the_time():
    rng = np.random.default_rng(0)
    covered = 0
    for draw in range(DRAWS):
        sums = synthetic_cell(rng, 0.6, np.full(PROMPTS, 5.0), 1.0)
        ci = B.alpha_interval(sums, B.resample_indices(PROMPTS, draw))
        covered += ci.low <= 0.6 <= ci.high
    assert 0.85 <= covered / DRAWS <= 0.99, covered / DRAWS


def test_paired_speedup_interval_covers_the_true_speedup_and_is_tight():
    """True speed-up 1.5; prompts differ 3x in cost, which pairing cancels."""
    rng = np.random.default_rng(1)
    covered, widths = 0, []
    for draw in range(DRAWS):
        prompt_ms = rng.uniform(3.0, 9.0, PROMPTS)
        base = synthetic_cell(rng, 0.6, prompt_ms, 1.0)
        spec = synthetic_cell(rng, 0.6, prompt_ms, 1.5)
        ci = B.speedup_interval(spec, base, B.resample_indices(PROMPTS, draw))
        covered += ci.low <= 1.5 <= ci.high
        widths.append(ci.high - ci.low)
    assert 0.85 <= covered / DRAWS <= 0.99, covered / DRAWS
    assert np.median(widths) < 0.1   # the 3x prompt spread would make an unpaired interval far wider


def test_no_interval_without_data():
    sums = B.PromptSums(np.zeros(3, int), np.zeros(3, int), np.zeros(3, int), np.ones((1, 3)), np.ones((1, 3), int))
    assert B.alpha_interval(sums, B.resample_indices(3, 0)) is None


def test_the_speedup_statistic_is_the_median_over_repetitions_so_a_slow_repetition_does_not_move_it():
    """One repetition of the method 3x slow (another job on the machine): the statistic, like the
    row's median ms/token, ignores it, so the interval stays around the true 1.5 and holds the point."""
    rng = np.random.default_rng(2)
    prompt_ms = rng.uniform(3.0, 9.0, PROMPTS)
    base = synthetic_cell(rng, 0.6, prompt_ms, 1.0)
    spec = synthetic_cell(rng, 0.6, prompt_ms, 1.5)
    spec.decode_s[1] *= 3.0
    idx = B.resample_indices(PROMPTS, 0)
    point = np.median(1000 * base.decode_s.sum(1) / base.decode_tokens.sum(1)) / \
        np.median(1000 * spec.decode_s.sum(1) / spec.decode_tokens.sum(1))
    ci = B.speedup_interval(spec, base, idx)
    assert ci.low <= point <= ci.high
    assert ci.low <= 1.5 <= ci.high
