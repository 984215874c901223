"""Distillation losses against hand-computed values on tiny tensors, plus limits, masks, stability and
property checks. P = teacher, Q = student throughout; logits are built as log-probabilities so the
distributions are the round numbers written in each test."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from draftsmith.train import losses

P = [0.8, 0.2]
Q = [0.5, 0.5]


def logits(probs) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64).log()[None, :]


def test_forward_and_reverse_kl_hand_values():
    """KL(P||Q) = 0.8 ln(0.8/0.5) + 0.2 ln(0.2/0.5); KL(Q||P) = 0.5 ln(0.5/0.8) + 0.5 ln(0.5/0.2)."""
    fwd = 0.8 * math.log(0.8 / 0.5) + 0.2 * math.log(0.2 / 0.5)
    rev = 0.5 * math.log(0.5 / 0.8) + 0.5 * math.log(0.5 / 0.2)
    assert losses.forward_kl(logits(Q), logits(P)).item() == pytest.approx(fwd, rel=1e-6)
    assert losses.reverse_kl(logits(Q), logits(P)).item() == pytest.approx(rev, rel=1e-6)


def test_forward_kl_from_teacher_log_probs_is_forward_kl():
    """A teacher given as log-probs (computed once, sliced per TTT step) scores exactly as its logits do,
    at a temperature and under a mask."""
    torch.manual_seed(0)
    student, teacher = torch.randn(3, 7, 11), torch.randn(3, 7, 11)
    mask = torch.rand(3, 7) > 0.3
    for temperature in (1.0, 0.7):
        expected = losses.forward_kl(student, teacher, temperature, mask)
        got = losses.forward_kl_log_target(student, losses.log_probs(teacher, temperature), temperature, mask)
        assert torch.equal(got, expected)


def test_temperature_softens_both_distributions():
    """At T=2 the teacher (0.8, 0.2) becomes (sqrt .8, sqrt .2)/Z = (2/3, 1/3); Q stays uniform:
    KL = 2/3 ln(4/3) + 1/3 ln(2/3)."""
    expected = 2 / 3 * math.log(4 / 3) + 1 / 3 * math.log(2 / 3)
    assert losses.forward_kl(logits(Q), logits(P), temperature=2.0).item() == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ValueError, match="temperature"):
        losses.forward_kl(logits(Q), logits(P), temperature=0.0)


def test_generalized_jsd_hand_values_and_limits():
    """beta=0.5: M=(0.65,0.35), JSD=[.5 KL(P||M)+.5 KL(Q||M)]/.25. beta=0.2: M=.2P+.8Q=(0.56,0.44).
    beta -> 0 / 1 approach forward / reverse KL continuously, and beta = 0 / 1 return them exactly."""
    def kl(a, b):
        return sum(x * math.log(x / y) for x, y in zip(a, b))

    for beta in (0.5, 0.2):
        m = [beta * p + (1 - beta) * q for p, q in zip(P, Q)]
        expected = (beta * kl(P, m) + (1 - beta) * kl(Q, m)) / (beta * (1 - beta))
        assert losses.generalized_jsd(logits(Q), logits(P), beta=beta).item() == pytest.approx(expected, rel=1e-6)
    fwd, rev = kl(P, Q), kl(Q, P)
    assert losses.generalized_jsd(logits(Q), logits(P), beta=0.0).item() == pytest.approx(fwd, rel=1e-9)
    assert losses.generalized_jsd(logits(Q), logits(P), beta=1.0).item() == pytest.approx(rev, rel=1e-9)
    assert losses.generalized_jsd(logits(Q), logits(P), beta=1e-5).item() == pytest.approx(fwd, rel=1e-3)
    assert losses.generalized_jsd(logits(Q), logits(P), beta=1 - 1e-5).item() == pytest.approx(rev, rel=1e-3)
    with pytest.raises(ValueError, match="beta"):
        losses.generalized_jsd(logits(Q), logits(P), beta=1.5)


def test_total_variation_hand_value():
    """TVD = 1/2 (|0.8-0.5| + |0.2-0.5|) = 0.3."""
    assert losses.total_variation(logits(Q), logits(P)).item() == pytest.approx(0.3, rel=1e-6)


def test_topk_soft_cross_entropy_renormalises_over_stored_k():
    """Student Q=(.1,.2,.3,.4); stored teacher top-2 ids [3, 2] with probs (.6, .2) -> renormalised (.75, .25):
    loss = -(0.75 ln 0.4 + 0.25 ln 0.3). Stored log-probs or raw logits give the same loss."""
    student = logits([0.1, 0.2, 0.3, 0.4])
    ids = torch.tensor([[3, 2]])
    expected = -(0.75 * math.log(0.4) + 0.25 * math.log(0.3))
    got = losses.topk_soft_cross_entropy(student, ids, torch.tensor([[0.6, 0.2]]).log())
    assert got.item() == pytest.approx(expected, rel=1e-6)
    shifted = losses.topk_soft_cross_entropy(student, ids, torch.tensor([[0.6, 0.2]]).log() + 7.0)
    assert shifted.item() == pytest.approx(expected, rel=1e-5)


def test_hard_cross_entropy_with_ignore_index_and_mask():
    """Row 0 targets id 3 (q=.4), row 1 is ignore_index, row 2 is masked: loss = -ln 0.4."""
    student = logits([0.1, 0.2, 0.3, 0.4]).repeat(3, 1)
    targets = torch.tensor([3, -100, 0])
    mask = torch.tensor([True, True, False])
    assert losses.hard_cross_entropy(student, targets, mask=mask).item() == pytest.approx(-math.log(0.4), rel=1e-6)


def test_feature_smooth_l1_hand_value():
    """beta=1: |0.5| < 1 -> 0.5*0.5^2 = 0.125; |3| >= 1 -> 3 - 0.5 = 2.5; mean over features = 1.3125."""
    pred, target = torch.tensor([[0.0, 0.0]]), torch.tensor([[0.5, 3.0]])
    assert losses.feature_smooth_l1(pred, target).item() == pytest.approx(1.3125, rel=1e-6)


def test_mask_averages_over_counted_positions_only():
    """[B=2, S=2] positions with one counted: the loss equals that position's value; all-False gives 0, not NaN."""
    student = torch.stack([logits(Q)[0], logits(P)[0]])[None].repeat(2, 1, 1)  # [2, 2, 2]
    teacher = logits(P)[None].repeat(2, 2, 1)
    mask = torch.tensor([[True, False], [False, False]])
    fwd = 0.8 * math.log(0.8 / 0.5) + 0.2 * math.log(0.2 / 0.5)
    assert losses.forward_kl(student, teacher, mask=mask).item() == pytest.approx(fwd, rel=1e-6)
    assert losses.forward_kl(student, teacher, mask=torch.zeros(2, 2, dtype=torch.bool)).item() == 0.0
    with pytest.raises(ValueError, match="mask shape"):
        losses.forward_kl(student, teacher, mask=torch.ones(3, dtype=torch.bool))


def test_numerical_stability_and_gradient():
    """Huge logits stay finite; teacher zeros (-inf logits) add nothing to forward KL; the gradient of forward
    KL w.r.t. student logits at T=1 is q - p (the textbook value)."""
    big = torch.tensor([[1e4, -1e4, 0.0]])
    for fn in (losses.forward_kl, losses.reverse_kl, losses.generalized_jsd, losses.total_variation):
        assert torch.isfinite(fn(big, big.flip(-1))).all(), fn.__name__
    teacher = torch.tensor([[0.0, float("-inf")]])  # P = (1, 0)
    student = logits(Q)
    assert losses.forward_kl(student, teacher).item() == pytest.approx(math.log(2), rel=1e-6)
    z = logits(Q).clone().requires_grad_(True)
    losses.forward_kl(z, logits(P)).backward()
    torch.testing.assert_close(z.grad, torch.tensor([[0.5 - 0.8, 0.5 - 0.2]], dtype=torch.float64))


def test_divergence_dispatch():
    """Config names map onto the functions; an unknown name is refused naming the choices."""
    assert losses.divergence("tv", logits(Q), logits(P)).item() == pytest.approx(0.3, rel=1e-6)
    assert losses.divergence("jsd", logits(Q), logits(P), beta=0.0).item() == pytest.approx(
        losses.forward_kl(logits(Q), logits(P)).item()
    )
    with pytest.raises(ValueError, match="forward_kl"):
        losses.divergence("kl", logits(Q), logits(P))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-8, 8), min_size=3, max_size=3), st.lists(st.floats(-8, 8), min_size=3, max_size=3), st.floats(0.0, 1.0))
def test_divergence_properties(a, b, beta):
    """For any pair of distributions: every divergence is >= 0, TV <= 1, and each is 0 when student == teacher."""
    s, t = torch.tensor([a], dtype=torch.float64), torch.tensor([b], dtype=torch.float64)
    for name in ("forward_kl", "reverse_kl", "tv"):
        assert losses.divergence(name, s, t).item() >= -1e-12
        assert abs(losses.divergence(name, t, t).item()) < 1e-12
    assert losses.generalized_jsd(s, t, beta=beta).item() >= -1e-9
    assert losses.total_variation(s, t).item() <= 1 + 1e-12
