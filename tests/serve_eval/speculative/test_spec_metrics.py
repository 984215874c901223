"""draftsmith.serve_eval.speculative.metrics: the definitions in its module docstring on scripted rounds, values computed by hand."""

from __future__ import annotations

import math

import pytest

from draftsmith.serve_eval.speculative.metrics import (
    SpecMetrics,
    SpecStats,
    latency_summary,
    ms_per_token,
    percentile,
    predicted_speedup,
    request_ms_per_token,
    speedup,
)


def scripted() -> SpecStats:
    """K=4 chains accepting 4, 2, 0, 3 drafts; draft 1 ms per token, target 10 ms per round."""
    stats = SpecStats()
    for accepted in (4, 2, 0, 3):
        stats.record_round(4, accepted, draft_time=0.004, target_time=0.010)
    return stats


def test_alpha_tau_and_per_position_by_hand():
    """alpha = 9/16, tau = 1 + 9/4, a_k = [3/4, 3/4, 2/4, 1/4] for the scripted rounds."""
    stats = scripted()
    assert stats.alpha == pytest.approx(9 / 16)
    assert stats.tau == pytest.approx(1 + 9 / 4)
    assert stats.num_emitted == 13
    assert stats.acceptance_by_position == pytest.approx([3 / 4, 3 / 4, 2 / 4, 1 / 4])
    assert stats.cost_ratio == pytest.approx(0.1)  # (16 ms / 16 tokens) / (40 ms / 4 rounds)
    assert stats.predicted_speedup() == pytest.approx((1 + 4 * 9 / 16) / (1 + 4 * 0.1))


def test_varying_k_and_tree_positions():
    """a_k only counts rounds that proposed a k-th token; a tree round proposes its depth, not its node count."""
    stats = SpecStats()
    stats.record_round(2, 2)
    stats.record_round(5, 1)
    stats.record_round(10, 3, num_positions=3)  # a 10-node tree of depth 3, accepted path of length 3
    assert stats.proposed_by_position == [3, 3, 2, 1, 1]
    assert stats.accepted_by_position == [3, 2, 1, 0, 0]
    assert stats.alpha == pytest.approx(6 / 17)
    assert stats.tau == pytest.approx(1 + 6 / 3)


def test_merge_equals_recording_everything_in_one():
    """Merging per-request stats gives the same counters as one accumulator over all rounds."""
    a, b, both = SpecStats(), SpecStats(), SpecStats()
    for stats, rounds in ((a, [(3, 1), (3, 3)]), (b, [(5, 0), (2, 2)])):
        for proposed, accepted in rounds:
            stats.record_round(proposed, accepted, 0.001, 0.01)
            both.record_round(proposed, accepted, 0.001, 0.01)
    assert SpecStats.merged([a, b]).to_dict() == both.to_dict()


def test_spec_metrics_by_request_and_domain():
    """Rounds land in the total, their domain (None -> 'default') and their request."""
    metrics = SpecMetrics()
    metrics.record_round("r1", "code", 4, 4)
    metrics.record_round("r2", "chat", 4, 0)
    metrics.record_round("r3", None, 2, 1)
    assert metrics.total.alpha == pytest.approx(5 / 10)
    assert metrics.by_domain["code"].alpha == 1.0 and metrics.by_domain["chat"].alpha == 0.0
    assert metrics.by_domain["default"].tau == 2.0
    assert metrics.pop_request("r1").num_accepted == 4 and "r1" not in metrics.by_request
    metrics.add_step_time(0.002, 0.010, {"code": 0.5, "chat": 0.5})
    assert metrics.by_domain["code"].target_time_s == pytest.approx(0.005)
    assert set(metrics.to_dict()["by_domain"]) == {"code", "chat", "default"}


def test_timing_definitions():
    """ms/token excludes prefill (first token); speedup and the seed formula by hand; empty -> nan."""
    assert ms_per_token(0.5, 100) == pytest.approx(5.0)
    assert request_ms_per_token(1.0, 1.9, 10) == pytest.approx(100.0)  # 9 decode tokens in 0.9 s
    assert math.isnan(request_ms_per_token(1.0, 1.0, 1))
    assert speedup(20.0, 8.0) == pytest.approx(2.5)
    assert predicted_speedup(4, 0.75, 0.05) == pytest.approx(4.0 / 1.2)


def test_percentiles():
    """p50/p99 use linear interpolation between order statistics (numpy's default)."""
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    summary = latency_summary([3.0, 1.0, 2.0])
    assert summary["p50"] == 2.0 and summary["mean"] == 2.0 and summary["count"] == 3
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match="q must be in"):
        percentile(values, 101)


def test_bad_rounds_raise():
    """Accepting more than proposed or negative times raise ValueError naming the values."""
    with pytest.raises(ValueError, match=r"num_accepted \(3\).*num_proposed \(2\)"):
        SpecStats().record_round(2, 3)
    with pytest.raises(ValueError, match="draft_time -1"):
        SpecStats().record_round(2, 1, draft_time=-1)
