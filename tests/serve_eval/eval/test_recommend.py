"""Recommendations per (domain, temperature) (method, K, or speculation off) on scripted results, judged on
the intervals' lower ends, and the YAML the server loads."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from draftsmith.serve_eval.eval.recommend import (DraftRoute, Recommendations, Thresholds, choose_for_cell, load_recommendations,
                                       policy_for_method, recommend, to_yaml, write_recommendations)
from draftsmith.serve_eval.eval.report import ResultRow


def r(domain, method, K, alpha, speedup, T=0.0, alpha_ci=None, speedup_ci=None) -> ResultRow:
    spec = method != "no-spec"
    return ResultRow(domain=domain, method=method, K=K, temperature=T, alpha=alpha if spec else None,
                     tau=None, a_k=[], ms_per_token=10.0, tokens_per_s=100.0, speedup=speedup,
                     predicted_speedup=None, ttft_p50=None, ttft_p99=None, itl_p50=None, itl_p99=None,
                     draft_time_share=None, target_time_share=None, repetitions=1, spread=0.0,
                     alpha_ci=alpha_ci, speedup_ci=speedup_ci)


SCRIPTED = [
    r("code", "no-spec", 0, None, 1.0), r("code", "eagle", 3, 0.70, 1.8), r("code", "eagle", 5, 0.65, 1.6),
    r("code", "standalone", 4, 0.80, 1.5), r("code", "assisted", 4, 0.90, 2.5),
    r("chat", "no-spec", 0, None, 1.0), r("chat", "eagle", 3, 0.45, 1.1), r("chat", "ngram", 2, 0.60, 0.9),
    r("math", "no-spec", 0, None, 1.0), r("math", "ngram", 4, 0.45, 2.0), r("math", "eagle", 3, 0.60, 1.3),
]


def test_best_passing_method_and_k_per_domain_with_an_alpha_floor():
    """With min_alpha 0.5: code -> eagle K=3 (best speed-up; the non-servable 'assisted' reference is
    ignored); math -> eagle K=3 because the faster ngram has alpha < 0.5; chat -> off (alpha 0.45 < 0.5,
    ngram's speed-up 0.9 < 1). The floor is also the fallback bar where the break-even lies below it."""
    recs = recommend(SCRIPTED, Thresholds(min_alpha=0.5), target_fingerprint="fp",
                     drafts={"eagle": DraftRoute("/d/eagle", "eagle")})
    [code], [chat], [math] = recs.domains["code"], recs.domains["chat"], recs.domains["math"]
    assert (code.speculate, code.method, code.K, code.speedup, code.alpha) == (True, "eagle", 3, 1.8, 0.70)
    assert (math.speculate, math.method, math.K) == (True, "eagle", 3)
    assert (chat.speculate, chat.method, chat.K) == (False, "no-spec", 0)
    assert "alpha 0.450 < 0.5" in chat.reason
    assert code.fallback == "no-spec" and code.fallback_below_alpha == 0.5
    assert code.draft_path == "/d/eagle" and recs.draft_paths() == {"eagle": "/d/eagle"}


def test_by_default_the_measured_speedup_decides_and_the_break_even_alpha_is_the_fallback_bar():
    """No alpha floor: math takes the faster ngram (alpha 0.45, 2.0x) and chat speculates with eagle at
    alpha 0.45 because it measured 1.1x. Each choice's fallback bar is where it stops paying: the speed-up
    scales with 1 + K alpha, so eagle K=3 at alpha 0.45 and 1.1x breaks even at (2.35 / 1.1 - 1) / 3."""
    recs = recommend(SCRIPTED)
    [code], [chat], [math] = recs.domains["code"], recs.domains["chat"], recs.domains["math"]
    assert (math.method, math.K, chat.method, chat.K, code.method) == ("ngram", 4, "eagle", 3, "eagle")
    assert chat.fallback_below_alpha == pytest.approx((2.35 / 1.1 - 1) / 3, abs=1e-3)
    assert code.fallback_below_alpha == pytest.approx((3.1 / 1.8 - 1) / 3, abs=1e-3)
    assert math.fallback_below_alpha == pytest.approx((2.8 / 2.0 - 1) / 4, abs=1e-3)
    assert all(c.fallback_below_alpha < c.alpha for c in (code, chat, math))
    # unseen domains: eagle K=3 passes in all three; it falls back at the least forgiving domain's bar
    # (math: alpha 0.6 at 1.3x breaks even at (2.8 / 1.3 - 1) / 3 = 0.385, above chat's 0.379)
    [default] = recs.default
    assert (default.method, default.K, default.fallback_below_alpha) == ("eagle", 3, 0.385)
    assert recs.fallback_bars() == {"code": code.fallback_below_alpha, "chat": chat.fallback_below_alpha,
                                    "math": math.fallback_below_alpha, "default": 0.385}


def test_the_fallback_bar_comes_from_the_speedup_s_lower_bound_and_the_measured_tau():
    """The bound that enabled a choice sets its bar (1.15x with a lower end of 1.0: at alpha 0.5, K=4, it
    stops paying at once), and tau counts the draft tokens really proposed (n-gram misses propose fewer)."""
    low = choose_for_cell([r("d", "eagle", 4, 0.5, 1.15, speedup_ci=[1.0, 1.3])], 0.0, Thresholds())
    assert low.speculate and low.fallback_below_alpha == 0.5
    row = r("d", "ngram", 4, 0.5, 1.5)
    row.tau = 1.5                      # one draft token per round on average, not 4
    assert choose_for_cell([row], 0.0, Thresholds()).fallback_below_alpha == 0.0   # 1.5 / 1.5 = 1 token/round


def test_break_even_alpha_by_hand_and_at_its_ends():
    from draftsmith.serve_eval.speculative.metrics import break_even_alpha

    assert break_even_alpha(0.5, 3.0, 1.5) == pytest.approx((3.0 / 1.5 - 1) / 4)   # K=4 full chains
    assert break_even_alpha(0.5, 3.0, 1.0) == pytest.approx(0.5)     # paying nothing: any drop stops it
    assert break_even_alpha(0.1, 1.2, 5.0) == 0.0                    # pays even at alpha 0
    assert break_even_alpha(0.9, 2.8, 0.1) == 1.0                    # never pays
    assert break_even_alpha(0.0, 1.0, 0.9) == 0.0                    # nothing accepted: no bar to derive
    with pytest.raises(ValueError, match="tau >= 1"):
        break_even_alpha(0.5, 0.5, 1.2)


def test_speedup_below_one_disables():
    """A candidate with good alpha but speed-up < 1 does not enable speculation."""
    choice = choose_for_cell([r("d", "ngram", 2, 0.9, 0.95)], 0.0, Thresholds())
    assert not choice.speculate and "speed-up 0.950 < 1" in choice.reason
    assert not choose_for_cell([r("d", "no-spec", 0, None, 1.0)], 0.0, Thresholds()).speculate


def test_each_temperature_is_decided_on_its_own():
    """A domain can speculate greedily and decode plainly when sampling: each (domain, T) gets its choice,
    and a request is served by the choice at the nearest measured temperature on its side of 0."""
    rows = [r("d", "eagle", 4, 0.8, 2.5, T=0.0), r("d", "eagle", 4, 0.4, 0.95, T=1.0),
            r("d", "eagle", 2, 0.7, 1.5, T=0.0), r("d", "eagle", 2, 0.45, 0.9, T=1.0)]
    recs = recommend(rows)
    greedy, sampled = recs.domains["d"]
    assert (greedy.temperature, greedy.speculate, greedy.method, greedy.K) == (0.0, True, "eagle", 4)
    assert (sampled.temperature, sampled.speculate) == (1.0, False)
    assert recs.choose("d", 0.0) is greedy and recs.choose("d", 0.7) is sampled and recs.choose("d", 1.3) is sampled
    assert recommend([rows[0]]).choose("d", 1.0) is None   # nothing measured when sampling


def test_the_lower_end_of_the_interval_decides():
    """alpha 0.55 whose interval reaches down to 0.45 does not pass min_alpha 0.5; a speed-up of 1.3 whose
    interval reaches 0.95 does not pass 1.0; between two passing candidates the higher lower bound wins."""
    floor = Thresholds(min_alpha=0.5)
    assert not choose_for_cell([r("d", "eagle", 4, 0.55, 1.5, alpha_ci=[0.45, 0.65])], 0.0, floor).speculate
    off = choose_for_cell([r("d", "eagle", 4, 0.7, 1.3, speedup_ci=[0.95, 1.6])], 0.0, Thresholds())
    assert not off.speculate and "95% CI low 0.950" in off.reason
    rows = [r("d", "eagle", 4, 0.7, 2.0, speedup_ci=[1.05, 2.9]), r("d", "standalone", 2, 0.7, 1.8,
                                                                    speedup_ci=[1.6, 2.0])]
    choice = choose_for_cell(rows, 0.0, Thresholds())
    assert (choice.method, choice.speedup_low) == ("standalone", 1.6)


def test_a_row_of_several_prompts_without_an_interval_is_not_enabled():
    """12 prompts, most of them answered with EOS at once: the bootstrap has no interval, so the point
    figure (2 prompts' worth) must not stand in; a one-prompt row (no bootstrap at all) still may."""
    few = r("d", "medusa", 4, 0.8, 1.9)
    few.num_prompts = 12
    off = choose_for_cell([few], 0.0, Thresholds())
    assert not off.speculate and "no 95% interval" in off.reason
    assert choose_for_cell([r("d", "medusa", 4, 0.8, 1.9)], 0.0, Thresholds()).speculate


def test_default_for_unseen_domains():
    """Default = the (method, K) passing in every domain with the best worst-case speed-up; else off."""
    rows = [r("a", "eagle", 3, 0.7, 2.0), r("a", "medusa", 3, 0.6, 3.0),
            r("b", "eagle", 3, 0.7, 1.5), r("b", "medusa", 3, 0.6, 1.2)]
    recs = recommend(rows)
    [default] = recs.default
    assert (default.speculate, default.method, default.K) == (True, "eagle", 3)
    assert recs.choose("unseen", 0.0) is default and recs.choose("a", 0.0).method == "medusa"
    [off] = recommend(SCRIPTED, Thresholds(min_alpha=0.5)).default  # chat passes nothing -> no safe default
    assert not off.speculate


def test_yaml_snippet_round_trips(tmp_path):
    """The snippet is YAML the server can load back to equal recommendations; bad files are refused."""
    recs = recommend(SCRIPTED, target_fingerprint="fp")
    path = write_recommendations(recs, tmp_path / "spec.yaml")
    assert path.read_text().startswith("# draftsmith speculative-decoding recommendations")
    assert load_recommendations(path) == recs
    assert "domains:" in to_yaml(recs)
    old = recs.to_dict()  # a v2 file (no proposer kind or draft dtype per choice) still loads
    old["schema_version"] = 2
    for choices in [old["default"], *old["domains"].values()]:
        for c in choices:
            c.pop("kind"), c.pop("draft_dtype")
    assert [c.method for c in Recommendations.from_dict(old).default] == [c.method for c in recs.default]
    bad = recs.to_dict()
    bad["schema_version"] = 99
    with pytest.raises(ValueError, match="schema_version"):
        Recommendations.from_dict(bad)
    bad = recs.to_dict()
    bad["domains"]["code"][0]["K"] = 0
    with pytest.raises(ValueError, match=r"domains\.code\[0\]\.K"):
        Recommendations.from_dict(bad)
    with pytest.raises(ValueError, match="no file"):
        load_recommendations(tmp_path / "missing.yaml")


row_strategy = st.builds(
    lambda m, K, a, s, T: r("d", m, K, a, s, T),
    st.sampled_from(["eagle", "medusa", "ngram", "standalone"]), st.integers(1, 6),
    st.floats(0, 1), st.floats(0.1, 4), st.sampled_from([0.0, 0.7, 1.0]))


@settings(max_examples=150, deadline=None)
@given(rows=st.lists(row_strategy, min_size=1, max_size=12, unique_by=lambda x: (x.method, x.K, x.temperature)))
def test_choice_passes_thresholds_and_is_best(rows):
    """For any results, per temperature: an enabled choice passes alpha >= 0.5 and speed-up >= 1, and no
    other passing (method, K) at that temperature has a higher speed-up; off only if none passes."""
    recs = recommend(rows, Thresholds(min_alpha=0.5))
    for choice in recs.domains["d"]:
        here = [x for x in rows if x.temperature == choice.temperature]
        passing = {(x.method, x.K): x.speedup for x in here if x.alpha >= 0.5 and x.speedup >= 1.0}
        assert choice.speculate == bool(passing)
        if passing:
            assert (choice.method, choice.K) in passing
            assert passing[(choice.method, choice.K)] == pytest.approx(max(passing.values()))


@settings(max_examples=150, deadline=None)
@given(rows=st.lists(row_strategy, min_size=1, max_size=12, unique_by=lambda x: (x.method, x.K, x.temperature)))
def test_by_default_an_enabled_choice_pays_and_falls_back_between_zero_and_its_alpha(rows):
    """Default thresholds: enabled exactly where some candidate measured a speed-up >= 1 (the best one), and
    its fallback bar lies in [0, its alpha]: at its own alpha it still pays."""
    recs = recommend(rows)
    for choice in recs.domains["d"]:
        here = [x for x in rows if x.temperature == choice.temperature]
        passing = {(x.method, x.K): x.speedup for x in here if x.speedup >= 1.0}
        assert choice.speculate == bool(passing)
        if passing:
            assert passing[(choice.method, choice.K)] == pytest.approx(max(passing.values()))
            assert 0.0 <= choice.fallback_below_alpha <= choice.alpha + 1e-3


def test_policy_for_one_method_fits_the_engine_policy_config():
    """For a server running EAGLE: per-domain K where EAGLE passes, the rest listed as disabled, and the
    policy keys construct the engine's SpecPolicyConfig."""
    from draftsmith.serve_eval.speculative.policy import SpecPolicyConfig

    snippet = policy_for_method(SCRIPTED, "eagle", Thresholds(min_alpha=0.5))
    assert snippet.policy["k_by_domain"] == {"code": 3, "math": 3}
    assert snippet.disabled_domains == ["chat"] and not snippet.default_speculate
    config = SpecPolicyConfig(**snippet.policy)
    assert config.k_by_domain == {"code": 3, "math": 3} and config.min_alpha == 0.5
    with pytest.raises(ValueError, match="no results for method 'medusa'"):
        policy_for_method(SCRIPTED, "medusa")


def test_policy_for_one_method_by_default_carries_each_domain_s_break_even():
    """Default thresholds: EAGLE speculates in every domain (each measured >= 1x), each falling back at its
    own break-even; unseen domains at the default's bar; without a safe default, the seed's 0.5."""
    from draftsmith.serve_eval.speculative.policy import SpecPolicyConfig

    snippet = policy_for_method(SCRIPTED, "eagle")
    config = SpecPolicyConfig(**snippet.policy)
    assert config.k_by_domain == {"chat": 3, "code": 3, "math": 3} and snippet.default_speculate
    assert config.min_alpha_by_domain["chat"] == pytest.approx((2.35 / 1.1 - 1) / 3, abs=1e-3)
    assert config.min_alpha == 0.385
    slow = [r("a", "eagle", 3, 0.7, 1.5), r("b", "eagle", 3, 0.7, 0.9)]
    assert policy_for_method(slow, "eagle").policy["min_alpha"] == 0.5
