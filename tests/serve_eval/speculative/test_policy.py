"""draftsmith.serve_eval.speculative.policy: per-domain K, fallback on low alpha with probing, adaptive K; scripted alphas."""

from __future__ import annotations

import pytest

from draftsmith.serve_eval.speculative.metrics import expected_speedup
from draftsmith.serve_eval.speculative.policy import SpecPolicy, SpecPolicyConfig, best_k


def config(**overrides) -> SpecPolicyConfig:
    base = dict(num_speculative_tokens=4, window_rounds=4, min_rounds=4, probe_after_steps=3)
    base.update(overrides)
    return SpecPolicyConfig(**base)


def test_per_domain_k_with_default():
    """k_by_domain overrides the default K; unknown and None domains get the default."""
    policy = SpecPolicy(config(k_by_domain={"code": 6, "default": 3}))
    assert policy.num_speculative_tokens("code") == 6
    assert policy.num_speculative_tokens("chat") == 4
    assert policy.num_speculative_tokens(None) == 3  # None is the "default" domain


def test_fallback_after_min_rounds_below_threshold_then_probe():
    """alpha 0.25 for 4 rounds turns the domain off; 3 plain steps later it probes with a fresh window."""
    policy = SpecPolicy(config())
    for _ in range(3):
        policy.observe_round("chat", 4, 1)
        assert policy.num_speculative_tokens("chat") == 4  # fewer than min_rounds: keep speculating
    policy.observe_round("chat", 4, 1)
    assert policy.num_speculative_tokens("chat") == 0 and policy.is_enabled("code")  # only chat is off
    for _ in range(2):
        policy.observe_non_spec_step("chat")
        assert policy.num_speculative_tokens("chat") == 0
    policy.observe_non_spec_step("chat")
    assert policy.num_speculative_tokens("chat") == 4
    assert policy.running_alpha("chat") != policy.running_alpha("chat")  # nan: window cleared


def test_a_domain_falls_back_below_its_own_bar():
    """min_alpha_by_domain (a recommended draft's measured break-even alpha) replaces min_alpha there:
    alpha 0.25 keeps chat on (bar 0.2) and switches code off (the default bar 0.5)."""
    policy = SpecPolicy(config(min_alpha_by_domain={"chat": 0.2}))
    for _ in range(4):
        policy.observe_round("chat", 4, 1)
        policy.observe_round("code", 4, 1)
    assert policy.is_enabled("chat") and not policy.is_enabled("code")
    assert (policy.min_alpha("chat"), policy.min_alpha("code")) == (0.2, 0.5)


def test_with_a_measured_gate_the_bar_is_the_measured_cost_ratio():
    """Beside a measured batch gate ("auto") the bar drops from 0.5 to the measured c = 0.12 once c is
    known: alpha 0.25 stays on, alpha 0 (below what any batch size could pay for) goes off. Without
    the gate, or with fallback_bar="fixed", 0.5 stands; a domain's own bar, or a min_alpha that was set, wins."""
    def run(policy: SpecPolicy, accepted: int) -> bool:
        for _ in range(4):
            policy.observe_round("chat", 4, accepted)
        return policy.is_enabled("chat")

    gated = SpecPolicy(config(), measured_gate=True)
    assert gated.min_alpha("chat") == 0.5            # c not measured yet
    gated.observe_cost_ratio(0.12)
    assert gated.min_alpha("chat") == 0.12 and run(gated, 1)
    low = SpecPolicy(config(), measured_gate=True)
    low.observe_cost_ratio(0.12)
    assert not run(low, 0)
    for policy in (SpecPolicy(config()), SpecPolicy(config(fallback_bar="fixed"), measured_gate=True)):
        policy.observe_cost_ratio(0.12)
        assert policy.min_alpha("chat") == 0.5 and not run(policy, 1)
    own = SpecPolicy(config(min_alpha_by_domain={"chat": 0.3}), measured_gate=True)
    own.observe_cost_ratio(0.12)
    assert own.min_alpha("chat") == 0.3
    chosen = SpecPolicy(config(min_alpha=0.4), measured_gate=True)   # a bar someone set stands under "auto"
    chosen.observe_cost_ratio(0.12)
    assert chosen.min_alpha("chat") == 0.4
    with pytest.raises(ValueError, match="fallback_bar"):
        config(fallback_bar="sometimes")


def test_the_fallback_judges_several_engine_steps_not_one_batch():
    """At batch 32 one step's 32 rounds fill window_rounds: the policy still waits for min_steps steps and
    keeps every round of the last min_steps steps. Three steps at alpha 0.5 and one at 0 read 0.375 over
    128 rounds (on, bar 0.3; the last 32 rounds alone read 0); one more step at 0 reads 0.25 (off)."""
    policy = SpecPolicy(SpecPolicyConfig(window_rounds=32, min_rounds=32, min_steps=4, min_alpha=0.3))
    for step, accepted in enumerate((2, 2, 2, 0)):
        for _ in range(32):
            policy.observe_round("math", 4, accepted, step=step)
    assert policy.is_enabled("math") and policy.running_alpha("math") == 0.375
    for _ in range(32):   # the window is now steps 1..4
        policy.observe_round("math", 4, 0, step=4)
    assert not policy.is_enabled("math")
    early = SpecPolicy(SpecPolicyConfig(window_rounds=32, min_rounds=32, min_steps=4, min_alpha=0.3))
    for step in range(3):   # 96 rounds at 0, but from 3 steps only: not judged yet
        for _ in range(32):
            early.observe_round("math", 4, 0, step=step)
    assert early.is_enabled("math")
    with pytest.raises(ValueError, match="min_steps"):
        SpecPolicyConfig(min_steps=0)


def test_high_alpha_stays_on_and_window_forgets_old_rounds():
    """A bad start recovered within the window keeps speculation on (alpha over the last 4 rounds)."""
    policy = SpecPolicy(config(min_rounds=6))
    for accepted in (0, 0, 4, 4, 4, 4):  # at round 6 the window holds only the last 4: alpha = 1
        policy.observe_round("code", 4, accepted)
    assert policy.is_enabled("code") and policy.running_alpha("code") == 1.0


def test_failed_probes_back_off_and_successful_probe_resets():
    """Each failed probe doubles the wait (capped); a probe that passes its check resets it."""
    policy = SpecPolicy(config(max_probe_after_steps=10))
    waits = []
    for _ in range(3):
        for _ in range(4):
            policy.observe_round("d", 4, 0)
        assert not policy.is_enabled("d")
        steps = 0
        while not policy.is_enabled("d"):
            policy.observe_non_spec_step("d")
            steps += 1
        waits.append(steps)
    assert waits == [3, 6, 10]
    for _ in range(4):
        policy.observe_round("d", 4, 3)
    assert policy.is_enabled("d") and policy.to_dict()["d"]["probe_wait"] == 3


def test_fallback_can_be_disabled():
    """With fallback off, a zero-alpha domain keeps speculating."""
    policy = SpecPolicy(config(fallback=False))
    for _ in range(10):
        policy.observe_round("d", 4, 0)
    assert policy.num_speculative_tokens("d") == 4


def test_expected_speedup_and_best_k_by_hand():
    """beta 0.8, c 0.05: K=1 gives 1.8/1.05; the best K balances extra tokens vs draft cost."""
    assert expected_speedup(1, 0.8, 0.05) == pytest.approx(1.8 / 1.05)
    assert expected_speedup(3, 1.0, 0.1) == pytest.approx(4 / 1.3)
    values = {k: expected_speedup(k, 0.8, 0.05) for k in range(1, 9)}
    assert best_k(0.8, 0.05, 1, 8) == max(values, key=values.get)
    assert best_k(0.3, 0.5, 1, 8) == 1  # poor acceptance, expensive draft: shortest chain
    assert best_k(0.99, 0.0, 1, 8) == 8  # free draft, near-perfect acceptance: longest


def test_adaptive_k_uses_measured_beta_and_cost():
    """Rounds accepting 3 of 4 give beta_hat = 3/4 (MLE); adaptive K is best_k(3/4, c)."""
    policy = SpecPolicy(config(adaptive_k=True, k_max=10))
    for _ in range(4):
        policy.observe_round("d", 4, 3)
    assert policy.num_speculative_tokens("d") == 4  # no cost ratio measured yet: configured K
    policy.observe_cost_ratio(0.1)
    assert policy.estimated_beta("d") == pytest.approx(0.75)
    assert policy.num_speculative_tokens("d") == best_k(0.75, 0.1, 1, 10)
    policy.observe_cost_ratio(0.2)
    assert policy.cost_ratio == pytest.approx(0.15)   # the median of the measurements so far


def test_a_catch_up_steps_cost_ratio_does_not_move_the_fallback_bar():
    """c is the median of the latest cost_ratio_window measurements: the first step after plain decoding (the draft's
    catch-up over every token since, c ~3.5 at batch 16) leaves the cost bar at the rounds' c, so a draft accepting
    0.4 keeps speculating where the batch gate measures it pays; an old measurement leaves the window."""
    policy = SpecPolicy(config(cost_ratio_window=4), measured_gate=True)
    for c in (3.5, 0.13, 0.12, 0.14):
        policy.observe_cost_ratio(c)
    assert policy.min_alpha("d") == pytest.approx(0.135)
    for step in range(40):
        policy.observe_round("d", 2, 1 if step % 5 else 0, step)   # alpha 0.4
    assert policy.is_enabled("d")
    policy.observe_cost_ratio(0.6)
    policy.observe_cost_ratio(0.6)
    assert policy.cost_ratio == pytest.approx(0.37)   # 3.5 has left the window: median of 0.12, 0.14, 0.6, 0.6


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(num_speculative_tokens=0), r"num_speculative_tokens \(K\) must be > 0, got 0"),
        (dict(k_by_domain={"code": -1}), r"k_by_domain\['code'\] \(K\) must be > 0, got -1"),
        (dict(min_alpha=1.5), "min_alpha must be in"),
        (dict(k_min=4, k_max=2), r"k_max \(2\) must be >= k_min \(4\)"),
        (dict(window_rounds=0), "window_rounds must be > 0"),
        (dict(cost_ratio_window=0), "cost_ratio_window must be > 0"),
    ],
)
def test_bad_config_raises(kwargs, message):
    """K <= 0 and other bad settings raise ValueError naming the field and value."""
    with pytest.raises(ValueError, match=message):
        SpecPolicyConfig(**kwargs)
