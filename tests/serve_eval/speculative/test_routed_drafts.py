"""Several drafts in one engine: each request speculates with the draft recommended for its domain and
temperature (method="routed"), greedy output stays identical, and the server shows the choice."""
from __future__ import annotations

import httpx

from draftsmith.serve_eval.engine import EngineConfig, LLMEngine, SamplingParams
from draftsmith.serve_eval.eval.recommend import DomainChoice, Recommendations, Thresholds, write_recommendations
from draftsmith.serve_eval.speculative.config import SpecConfig
from spec_helpers import feature_draft, greedy_reference, make_llama, run_engine, workload


def routes(tmp_path, eagle_dir) -> str:
    on = lambda method, K, path=None, T=0.0: DomainChoice(True, method, K, T, path)  # noqa: E731
    off = lambda T: DomainChoice(False, "no-spec", 0, T)  # noqa: E731
    recs = Recommendations(Thresholds(), [on("ngram", 2)],
                           {"chat": [on("eagle", 3, str(eagle_dir)), off(1.0)], "code": [on("ngram", 4)],
                            "prose": [off(0.0)]}, "fp")
    return str(write_recommendations(recs, tmp_path / "recommendations.yaml"))


def test_each_domain_speculates_with_its_recommended_draft_and_output_is_exact(tmp_path):
    target = make_llama(tmp_path / "target")
    eagle = feature_draft("eagle", target, tmp_path / "eagle")
    prompts, lengths = workload(8, seed=5)
    domains = ["chat", "code", "prose", "unseen"] * 2
    reference = greedy_reference(target, prompts, lengths)
    spec = SpecConfig("routed", routes=routes(tmp_path, eagle))
    assert spec.num_speculative_tokens == 4   # the largest recommended K
    engine = LLMEngine(EngineConfig(str(target)), speculative=spec)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    outputs = run_engine(engine, prompts, params, domains)
    assert {rid: out.output_token_ids for rid, out in outputs.items()} == reference
    rounds = engine.strategy.proposer.rounds_by_draft()
    assert rounds.get(("chat", "eagle"), 0) > 0 and rounds.get(("code", "ngram"), 0) > 0
    assert rounds.get(("unseen", "ngram"), 0) > 0            # the default choice
    assert not any(domain == "prose" for domain, _ in rounds)  # recommended off: plain decoding
    assert not any(method == "eagle" and domain != "chat" for domain, method in rounds)
    by_domain = engine.stats().spec.by_domain
    assert "prose" not in by_domain and by_domain["code"].num_rounds > 0


def test_a_routed_config_falls_back_below_each_domain_s_break_even(tmp_path):
    """The policy of a routed engine takes each domain's bar from its choices (the lowest where two
    temperatures speculate), the default's for unseen domains, and a bar the caller names wins."""
    from draftsmith.serve_eval.speculative.policy import SpecPolicyConfig

    on = lambda K, T, bar: DomainChoice(True, "ngram", K, T, fallback_below_alpha=bar)  # noqa: E731
    recs = Recommendations(Thresholds(), [on(2, 0.0, 0.3)], {"chat": [on(3, 0.0, 0.25), on(2, 1.0, 0.1)],
                                                             "prose": [DomainChoice(False, "no-spec", 0, 0.0)]})
    path = str(write_recommendations(recs, tmp_path / "recommendations.yaml"))
    from draftsmith.serve_eval.speculative.policy import SpecPolicy

    routed = SpecPolicy(SpecConfig("routed", routes=path).policy)
    assert routed.config.min_alpha_by_domain == {"chat": 0.1}
    assert (routed.min_alpha("chat"), routed.min_alpha("unseen"), routed.min_alpha(None)) == (0.1, 0.3, 0.3)
    mine = SpecConfig("routed", routes=path, policy=SpecPolicyConfig(min_alpha=0.6, min_alpha_by_domain={"chat": 0.4}))
    assert mine.policy.min_alpha_by_domain == {"chat": 0.4} and mine.policy.min_alpha == 0.6


def test_a_sampled_request_follows_the_temperature_choice(tmp_path):
    """chat at T=1 is recommended off: such a request decodes plainly while a greedy chat one speculates."""
    target = make_llama(tmp_path / "target")
    eagle = feature_draft("eagle", target, tmp_path / "eagle")
    engine = LLMEngine(EngineConfig(str(target)), speculative=SpecConfig("routed", routes=routes(tmp_path, eagle)))
    prompts, _ = workload(2, seed=1)
    params = [SamplingParams(temperature=1.0, max_tokens=12, seed=3, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    run_engine(engine, prompts, params, ["chat", "chat"])
    stats = engine.stats().spec
    assert stats.rounds_by_draft.get(("chat", "eagle"), 0) > 0
    assert stats.by_domain["chat"].num_rounds <= 12   # only the greedy request's rounds


def test_the_server_serves_from_a_recommendations_file_and_shows_the_choice(tmp_path):
    from draftsmith.serve_eval.server.run import ServeConfig, build_app
    from draftsmith.serve_eval.server.testing import ServerThread, build_tiny_checkpoint

    target = build_tiny_checkpoint(tmp_path / "target", max_position=128)
    eagle = feature_draft("eagle", target, tmp_path / "eagle")
    cfg = ServeConfig(num_gpu_blocks=64, max_model_len=128, recommendations=routes(tmp_path, eagle),
                      batch_gate="off")   # every request speculates as recommended, whatever it costs here
    with ServerThread(build_app(str(target), cfg)) as server, \
            httpx.Client(base_url=server.base_url, timeout=60) as c:
        for domain in ("chat", "code", "prose"):
            r = c.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 8, "temperature": 0,
                                                "ignore_eos": True, "domain": domain})
            assert r.status_code == 200
        text = c.get("/metrics").text
    assert 'draftsmith:spec_decode_num_drafts_by_draft_total{domain="chat",method="eagle"}' in text
    assert 'draftsmith:spec_decode_num_drafts_by_draft_total{domain="code",method="ngram"}' in text
    assert 'domain="prose",method=' not in text


def test_routed_trees_feed_each_childs_cost_model(tmp_path):
    """tree='dynamic' under routing: the EAGLE child proposes cost-sized trees and the n-gram child chains; the
    target's verify curve is probed into the EAGLE child's cost model, every verified tree of its requests
    calibrates it, its step share is measured, and greedy output stays exact (trees or chains, as its budget
    chooses)."""
    target = make_llama(tmp_path / "target")
    eagle = feature_draft("eagle", target, tmp_path / "eagle")
    prompts, lengths = workload(6, seed=7)
    domains = ["chat", "code", "chat", "code", "chat", "prose"]
    reference = greedy_reference(target, prompts, lengths)
    spec = SpecConfig("routed", routes=routes(tmp_path, eagle), tree="dynamic", tree_top_k=2, max_draft_nodes=6)
    engine = LLMEngine(EngineConfig(str(target)), speculative=spec)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    outputs = run_engine(engine, prompts, params, domains)
    assert {rid: out.output_token_ids for rid, out in outputs.items()} == reference
    proposer = engine.strategy.proposer
    eagle_child, ngram_child = proposer.children["eagle"], proposer.children["ngram"]
    budget = eagle_child.tree_budget
    assert eagle_child.tree is not None and budget is not None and ngram_child.tree_budgets() == ()
    assert proposer.tree_budgets() == (budget,)
    assert budget.curve is not None and budget.measured
    stats = engine.stats().spec
    # chat routes to EAGLE only: its rounds are trees (each calibrates) or, where the budget measured them cheaper,
    # chains
    assert 0 < budget.calibration.rounds <= stats.by_domain["chat"].num_rounds
    assert stats.by_domain["code"].num_rounds > 0   # n-gram chains in the same engine
