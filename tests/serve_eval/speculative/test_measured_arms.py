"""speculative.measured_arms: an arm's cost is read through a median of its latest measurements (per measurement,
or its seconds over its mean tokens), and the re-try interval doubles with each confirmation up to its cap and falls back to its base when a re-tried arm wins."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from draftsmith.serve_eval.speculative.measured_arms import ArmCosts, RetryBackoff


def test_an_arms_cost_is_the_median_of_its_window_so_one_spike_does_not_move_it():
    arm = ArmCosts(window=5)
    assert arm.median() is None
    for cost in (1.0, 1.1, 0.9, 1.0, 9.0):   # one step at 9x its typical cost
        arm.observe(2 * cost, 2)
    assert arm.median() == 1.0
    for cost in (2.0, 2.0, 2.0):             # the window keeps the latest five: the arm got dearer
        arm.observe(cost, 1)
    assert arm.median() == 2.0 and arm.samples == 8
    arm.restart()
    assert arm.median() is None and arm.rate() is None and arm.samples == 8


def test_an_arms_rate_counts_every_token_where_its_median_per_measurement_does_not():
    """Rounds of one cost (6 ms) that emit 1, 1 or 5 tokens: 7/3 tokens a round, so 6 / (7/3) ms per token; the median
    of the rounds' own ratios reads the 1-token rounds alone (6 ms). A spiked round still stays out of the rate."""
    arm = ArmCosts(window=9)
    for tokens in (1, 1, 5) * 3:
        arm.observe(6.0, tokens)
    assert arm.median() == 6.0
    assert arm.rate() == pytest.approx(6.0 / (7 / 3))
    arm.observe(60.0, 1)   # one spike (it pushes out the first round, a 1-token one)
    assert arm.rate() == pytest.approx(6.0 / (21 / 9))


def test_an_arms_rate_follows_a_change_of_cost_in_its_short_seconds_window():
    """rate_seconds 3 of a window of 9: three rounds at a new cost move the rate; the tokens stay averaged over 9."""
    arm = ArmCosts(window=9, rate_seconds=3)
    for tokens in (1, 1, 5) * 3:
        arm.observe(6.0, tokens)
    for tokens in (1, 1, 5):
        arm.observe(3.0, tokens)
    assert arm.rate() == pytest.approx(3.0 / (7 / 3))


@given(st.integers(1, 8), st.integers(0, 6), st.lists(st.sampled_from(["tick", "confirm", "flip"]),
                                                      max_size=60))
def test_retry_interval_doubles_per_confirmation_up_to_its_cap_and_a_flip_resets_it(base, doublings, events):
    cap = base * 2 ** doublings
    backoff, confirms, since = RetryBackoff(base, cap), 0, 0
    for event in events:
        if event == "tick":
            backoff.tick()
            since += 1
        else:
            getattr(backoff, event)()
            since = 0
            confirms = 0 if event == "flip" else confirms + (event == "confirm")
        assert backoff.interval == min(base * 2 ** confirms, cap)
        assert backoff.since == since and backoff.due == (since >= backoff.interval)


def test_bad_settings_name_the_values():
    with pytest.raises(ValueError, match="got 0 and None"):
        ArmCosts(window=0)
    with pytest.raises(ValueError, match="got 4 and 5"):
        ArmCosts(window=4, rate_seconds=5)
    with pytest.raises(ValueError, match="tokens > 0, got 0"):
        ArmCosts(window=1).observe(1.0, 0)
    with pytest.raises(ValueError, match="base 8, cap 4"):
        RetryBackoff(8, 4)
