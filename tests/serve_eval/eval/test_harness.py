"""The eval harness: metrics of scripted runs with known values, same-run speed-ups, skipped entries,
valid report files, a real tiny-engine run, the hook's evaluate() entry and the Hydra job door."""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import yaml

from draftsmith.serve_eval.eval import harness
from draftsmith.serve_eval.eval.harness import MethodPlan, run_cells, run_eval, write_outputs
from draftsmith.serve_eval.eval.rows import build_row
from draftsmith.serve_eval.eval.recommend import load_recommendations
from draftsmith.serve_eval.eval.report import SkippedEntry, load_report
from draftsmith.serve_eval.eval.runners import RequestRecord, RunResult, RunSpec
from draftsmith.serve_eval.eval.settings import load_settings
from draftsmith.serve_eval.eval.sources import DraftSource, group_prompts, load_prompt_records
from draftsmith.serve_eval.schemas import EngineSettings, EvalConfig
from draftsmith.serve_eval.speculative.metrics import SpecStats


def _stats(rounds: list[tuple[int, int]]) -> SpecStats:
    s = SpecStats()
    for proposed, accepted in rounds:
        s.record_round(proposed, accepted)
    return s


def _rep(b_gap: float) -> RunResult:
    a = RequestRecord(4, 0.5, [1.0, 1.01, 1.02, 1.03], _stats([(2, 2), (2, 0)]))
    b = RequestRecord(3, 0.3, [2.0, 2.0 + b_gap, 2.0 + 2 * b_gap], _stats([(2, 1)]))
    return RunResult([a, b], wall_s=0.5, draft_time_s=0.012, target_time_s=0.06, busy_time_s=0.1)


def test_build_row_known_values():
    """Every figure of a row from two scripted repetitions equals its hand-computed value, including
    the seed formula (1 + K alpha) / (1 + K c) with c from measured times."""
    row = build_row("code", "standalone", 2, 0.0, [_rep(0.02), _rep(0.03)], baseline_ms_per_token=32.0)
    # decode ms/token per repetition: (0.03 + 2 * gap) s over (3 + 2) tokens
    assert row.ms_per_token_samples == pytest.approx([14.0, 18.0])
    assert row.ms_per_token == pytest.approx(16.0)
    assert row.spread == pytest.approx(math.sqrt(8.0))
    assert row.speedup == pytest.approx(2.0)
    assert row.tokens_per_s == pytest.approx(14 / 1.0)
    # rounds 6, proposed 12, accepted 6; position 1 accepted in 4 of 6 rounds, position 2 in 2 of 6
    assert row.alpha == pytest.approx(0.5)
    assert row.tau == pytest.approx(2.0)
    assert row.a_k == pytest.approx([4 / 6, 2 / 6])
    c = (0.024 / 12) / (0.12 / 6)
    assert row.predicted_speedup == pytest.approx((1 + 2 * 0.5) / (1 + 2 * c))
    assert row.draft_time_share == pytest.approx(0.12)
    assert row.target_time_share == pytest.approx(0.6)
    assert row.ttft_p50 == pytest.approx(0.4) and row.ttft_p99 == pytest.approx(0.5)  # ranks 2..3 of [.3, .3, .5, .5]
    assert row.itl_p50 == pytest.approx(0.01)
    assert row.repetitions == 2


def test_baseline_row_has_speedup_one_and_no_spec_metrics():
    """no-spec: speed-up exactly 1 against itself, no alpha/tau/a_k, no prediction."""
    row = build_row("code", "no-spec", 0, 0.0, [_rep(0.02)], baseline_ms_per_token=None)
    assert row.speedup == 1.0
    assert row.alpha is None and row.tau is None and row.a_k == [] and row.predicted_speedup is None


class ScriptedRunner:
    """ms/token fixed per (domain, temperature); the runner's first call at each temperature (the warm-up)
    is slow, so a result that included it would show."""

    def __init__(self, method: str, K: int, ms: dict, accept: tuple[int, int] | None = None,
                 fail_domains: tuple[str, ...] = ()):
        self.method, self.K, self.ms, self.accept, self.fail_domains = method, K, ms, accept, fail_domains
        self.calls: list[tuple[str, float, int]] = []

    def run(self, prompts, spec: RunSpec, domain):
        if domain in self.fail_domains:
            raise RuntimeError(f"scripted failure in {domain}")
        first = not any(c[1] == spec.temperature for c in self.calls)
        self.calls.append((domain, spec.temperature, len(prompts)))
        gap = (1.0 if first else self.ms[(domain, spec.temperature)] / 1000)
        records = []
        for _ in prompts:
            times = [10 + i * gap for i in range(5)]
            stats = _stats([self.accept] * 2) if self.accept else None
            records.append(RequestRecord(5, 0.1, times, stats))
        return RunResult(records, 1.0, 0.001 if self.K else 0.0, 0.01, 0.02)

    def close(self):
        pass


def _cfg(**kw) -> EvalConfig:
    base = dict(methods=["no-spec", "ngram"], num_speculative_tokens=[2], temperatures=[0.0, 1.0],
                repetitions=2, warmup=1, max_tokens=8)
    return EvalConfig(**{**base, **kw})


def test_speedup_is_against_the_same_runs_no_spec_per_domain_and_temperature():
    """Speed-up = that (domain, T)'s no-spec ms/token / the method's; warm-up calls are not measured."""
    base = {("a", 0.0): 10.0, ("a", 1.0): 30.0, ("b", 0.0): 20.0, ("b", 1.0): 20.0}
    fast = {k: 5.0 for k in base}
    runners = {}

    def factory(plan: MethodPlan):
        runners[plan.method] = ScriptedRunner(plan.method, plan.K, base if plan.K == 0 else fast,
                                              None if plan.K == 0 else (2, 1))
        return runners[plan.method]

    cfg = _cfg()
    plans = [MethodPlan("no-spec", 0), MethodPlan("ngram", 2, "ngram")]
    rows = run_cells(cfg, plans, {"a": ["p1", "p2"], "b": ["p3"]}, factory, [])
    by = {(r.domain, r.method, r.temperature): r for r in rows}
    assert by[("a", "ngram", 0.0)].speedup == pytest.approx(2.0)
    assert by[("a", "ngram", 1.0)].speedup == pytest.approx(6.0)
    assert by[("b", "ngram", 0.0)].speedup == pytest.approx(4.0)
    assert by[("a", "no-spec", 0.0)].ms_per_token == pytest.approx(10.0)  # slow warm-up excluded
    assert all(r.repetitions == 2 for r in rows)
    # per method and temperature one warm-up call with `warmup` prompts before its first cell, then
    # `repetitions` full passes per cell
    assert [c for c in runners["ngram"].calls if c[:2] == ("a", 0.0)] == [("a", 0.0, 1), ("a", 0.0, 2), ("a", 0.0, 2)]
    assert [c for c in runners["ngram"].calls if c[:2] == ("b", 0.0)] == [("b", 0.0, 1), ("b", 0.0, 1)]


def test_a_method_runs_only_at_its_temperatures_and_the_baseline_at_every_one():
    """eval.temperatures_of drops a method where it is not wanted; the others and no-spec run everywhere,
    and each repetition after the first logs a progress line."""
    ran: list[tuple[str, float]] = []

    class Logged(ScriptedRunner):
        def run(self, prompts, spec, domain):
            ran.append((self.method, spec.temperature))
            return super().run(prompts, spec, domain)

    def factory(plan: MethodPlan):
        return Logged(plan.method, plan.K, {("a", 0.0): 10.0, ("a", 1.0): 10.0}, None if plan.K == 0 else (2, 1))

    plans = [MethodPlan("no-spec", 0), MethodPlan("ngram", 2, "ngram"), MethodPlan("ngram4", 4, "ngram")]
    lines: list[str] = []
    rows = run_cells(_cfg(temperatures_of={"ngram4": [0.0]}, warmup=0), plans, {"a": ["p1"]}, factory, [],
                     lines.append)
    assert sorted({(r.method, r.temperature) for r in rows}) == [
        ("ngram", 0.0), ("ngram", 1.0), ("ngram4", 0.0), ("no-spec", 0.0), ("no-spec", 1.0)]
    assert ("ngram4", 1.0) not in ran
    assert "eval repetition 2/2 domain=a T=1 (2 methods)" in lines


def test_a_temperatures_of_label_the_run_does_not_measure_is_noted(tmp_path):
    """A misspelt or absent label in eval.temperatures_of would silently change nothing: the plan says so."""
    notes: list[str] = []
    plans = harness.plan_methods(_cfg(temperatures_of={"ngram": [0.0], "standalone@int4": [0.0]}), [], tmp_path,
                                 [], notes)
    assert {p.method for p in plans} == {"no-spec", "ngram"}
    assert [n for n in notes if "temperatures_of" in n] == [
        "eval.temperatures_of names 'standalone@int4', which this run does not measure (measured: "
        "['ngram', 'no-spec'])"]


def test_repetitions_are_interleaved_with_the_method_order_rotated():
    """Repetition r runs every method of a (domain, T) before repetition r + 1 starts, and begins with
    method r mod M, so a slow spell of the machine is shared by all methods."""
    log: list[tuple[str, int]] = []

    class Logged(ScriptedRunner):
        def run(self, prompts, spec, domain):
            log.append((self.method, len(prompts)))
            return super().run(prompts, spec, domain)

    def factory(plan: MethodPlan):
        return Logged(plan.method, plan.K, {("a", 0.0): 10.0}, None if plan.K == 0 else (2, 1))

    plans = [MethodPlan("no-spec", 0), MethodPlan("ngram", 2, "ngram"), MethodPlan("ngram4", 4, "ngram")]
    run_cells(_cfg(temperatures=[0.0], repetitions=3, warmup=0), plans, {"a": ["p1", "p2"]}, factory, [])
    assert [m for m, _ in log] == ["no-spec", "ngram", "ngram4", "ngram", "ngram4", "no-spec",
                                   "ngram4", "no-spec", "ngram"]


@pytest.mark.parametrize("max_minutes,repetitions", [(None, 3), (5.0, 2), (1.0, 1)])
def test_the_wall_clock_cap_ends_the_sweep_between_repetitions(monkeypatch, caplog, max_minutes, repetitions):
    """Scripted clock: every cell's pass takes a minute, 2 methods, so a repetition takes 2. With eval.max_minutes
    a repetition starts only if the minutes so far plus one more average repetition fit (5: 2 + 2 fits, 4 + 2 does
    not), the first always runs, every cell keeps the same count, and the cut is logged."""
    clock = [0.0]
    monkeypatch.setattr(harness.time, "perf_counter", lambda: clock[0])

    class Timed(ScriptedRunner):
        def run(self, prompts, spec, domain):
            clock[0] += 60.0 if len(prompts) == 2 else 0.0   # the measured pass; the 1-prompt warm-up is free
            return super().run(prompts, spec, domain)

    def factory(plan: MethodPlan):
        return Timed(plan.method, plan.K, {("a", 0.0): 10.0}, None if plan.K == 0 else (2, 1))

    plans = [MethodPlan("no-spec", 0), MethodPlan("ngram", 2, "ngram")]
    with caplog.at_level("WARNING"):
        rows = run_cells(_cfg(temperatures=[0.0], repetitions=3, max_minutes=max_minutes), plans,
                         {"a": ["p1", "p2"]}, factory, [])
    assert [r.repetitions for r in rows] == [repetitions, repetitions]
    cut = [r.message for r in caplog.records if "eval.max_minutes" in r.message]
    assert (cut == []) == (repetitions == 3)
    if cut:
        assert f"after {repetitions} of 3 repetitions" in cut[0]


def test_a_cap_that_is_not_positive_is_refused():
    from draftsmith.serve_eval.eval.settings import validate

    with pytest.raises(ValueError, match="eval.max_minutes"):
        validate(_cfg(max_minutes=0))


def test_rows_carry_bootstrap_intervals_that_contain_their_figure():
    """alpha, tau and speed-up intervals over prompts: ordered, around the point figure, and a
    speed-up interval only where a paired baseline exists."""
    base = {("a", 0.0): 10.0}

    def factory(plan: MethodPlan):
        return ScriptedRunner(plan.method, plan.K, base if plan.K == 0 else {("a", 0.0): 5.0},
                              None if plan.K == 0 else (2, 1))

    plans = [MethodPlan("no-spec", 0), MethodPlan("ngram", 2, "ngram")]
    rows = run_cells(_cfg(temperatures=[0.0]), plans, {"a": ["p1", "p2", "p3", "p4"]}, factory, [])
    by = {r.method: r for r in rows}
    spec = by["ngram"]
    assert spec.num_prompts == 4
    for value, ci in ((spec.alpha, spec.alpha_ci), (spec.tau, spec.tau_ci), (spec.speedup, spec.speedup_ci)):
        assert ci[0] <= value + 1e-9 and value <= ci[1] + 1e-9
    assert by["no-spec"].alpha_ci is None and by["no-spec"].speedup_ci is None   # exactly 1: no interval


def test_a_speedup_interval_holds_its_point_when_prompts_and_repetitions_differ_in_cost():
    """Prompts of 1x-4x cost and one repetition slow for each method: the row's speed-up (median ms/token
    over repetitions) lies inside its bootstrap interval, which resamples that same statistic."""
    prompt_cost = [1.0, 2.0, 4.0, 1.5, 3.0, 2.5]
    slow_rep = {"no-spec": 0, "ngram": 2}

    class Uneven(ScriptedRunner):
        def run(self, prompts, spec, domain):
            rep = len(self.calls) - 1            # the first call is the warm-up
            self.calls.append((domain, spec.temperature, len(prompts)))
            scale = (10.0 if self.K == 0 else 5.0) * (2.5 if rep == slow_rep[self.method] else 1.0)
            records = []
            for i, _ in enumerate(prompts):
                gap = scale * prompt_cost[i] / 1000 * (1 + 0.05 * ((i + rep) % 3))
                records.append(RequestRecord(5, 0.1, [10 + j * gap for j in range(5)],
                                             _stats([(2, 1)] * 2) if self.K else None))
            return RunResult(records, 1.0, 0.001 if self.K else 0.0, 0.01, 0.02)

    plans = [MethodPlan("no-spec", 0), MethodPlan("ngram", 2, "ngram")]
    rows = run_cells(_cfg(temperatures=[0.0], repetitions=3),  plans, {"a": [f"p{i}" for i in range(6)]},
                     lambda plan: Uneven(plan.method, plan.K, {}, None), [])
    spec = {r.method: r for r in rows}["ngram"]
    assert spec.speedup_ci[0] <= spec.speedup <= spec.speedup_ci[1], (spec.speedup, spec.speedup_ci)


def _tiny_standalone(target: dict, path: Path) -> Path:
    from draftsmith.drafts.io import save_draft
    from draftsmith.drafts.standalone import StandaloneDraft

    return save_draft(StandaloneDraft.from_target_config(target, num_layers=1), path, target_fingerprint="other-fp")


TARGET_CFG = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, architectures=["LlamaForCausalLM"])


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    from draftsmith.serve_eval.server.testing import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("target"), num_layers=2, hidden_size=64)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "eval.jsonl"
    recs = [{"domain": d, "prompt": f"hello world say {w} the cat and the dog {w}", "reference": "x"}
            for d in ("chat", "code") for w in ("one", "two", "three")]
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    return path


def test_bad_inputs_become_skipped_entries_while_the_rest_runs(tiny_target, prompts_file, tmp_path):
    """A domain without prompts, a draft built for another target, a method that cannot start and a
    cell that fails mid-run each become a SkippedEntry with its reason; the other cells still report."""
    prompts, skipped = group_prompts(load_prompt_records(prompts_file), ["chat", "code", "math"], lambda _: 2, "eval.jsonl")
    assert set(prompts) == {"chat", "code"}
    assert skipped == [SkippedEntry("math", "*", skipped[0].reason)] and "no prompts for domain 'math'" in skipped[0].reason
    foreign = _tiny_standalone({**TARGET_CFG, "vocab_size": 77}, tmp_path / "foreign")

    def factory(plan: MethodPlan):
        if plan.method == "ngram":
            raise RuntimeError("n-gram proposer exploded")
        return ScriptedRunner(plan.method, plan.K, {(d, 0.0): 10.0 for d in prompts}, None,
                              fail_domains=("code",) if plan.method == "no-spec" else ())

    cfg = _cfg(temperatures=[0.0], methods=["no-spec", "ngram", "drafts"])
    report = run_eval(cfg, tiny_target, "fp", prompts, [DraftSource("foreign", foreign, "standalone")], skipped,
                      factory=factory)
    reasons = {(s.domain, s.method): s.reason for s in report.skipped}
    assert "vocab_size" in reasons[("*", "foreign")]
    assert "n-gram proposer exploded" in reasons[("*", "ngram")]
    assert "scripted failure in code" in reasons[("code", "no-spec")]
    assert ("math", "*") in reasons
    assert [(r.domain, r.method) for r in report.results] == [("chat", "no-spec")]


def test_report_files_are_valid_and_recommend_from_measured_rows(tmp_path):
    """write_outputs: report.json loads back under its schema, report.md and PNGs exist, and
    recommendations.yaml picks the method that passes alpha and speed-up bars."""
    def factory(plan: MethodPlan):
        ms = {("a", 0.0): 10.0 if plan.K == 0 else 4.0}
        return ScriptedRunner(plan.method, plan.K, ms, None if plan.K == 0 else (2, 2))

    cfg = _cfg(temperatures=[0.0])
    report = run_eval(cfg, tmp_path, "fp123", {"a": ["p"]}, [], [], factory=factory)
    files = write_outputs(report, tmp_path / "out", plots=True)
    loaded = load_report(files.json)
    assert [(r.method, r.K) for r in loaded.results] == [("no-spec", 0), ("ngram", 2)]
    assert loaded.results[1].speedup == pytest.approx(2.5) and loaded.results[1].alpha == 1.0
    assert files.markdown.read_text().startswith("# draftsmith eval report")
    assert files.plots and all(p.stat().st_size > 0 for p in files.plots.values())
    recs = load_recommendations(tmp_path / "out" / "recommendations.yaml")
    choice = recs.choose("a", 0.0)
    assert choice.speculate and (choice.method, choice.K) == ("ngram", 2)
    assert yaml.safe_load((tmp_path / "out" / "recommendations.yaml").read_text())["target_fingerprint"] == "fp123"


def test_acceptance_only_run_skips_the_baseline_and_writes_no_speedups(tmp_path):
    """eval.methods without no-spec (the hook's `acceptance` profile): the baseline never runs, rows carry
    alpha and tau but no speed-up, the report says so, and nothing speculates on an unmeasured speed-up."""
    built = []

    def factory(plan: MethodPlan):
        built.append(plan.method)
        return ScriptedRunner(plan.method, plan.K, {("a", 0.0): 4.0}, (2, 2))

    report = run_eval(_cfg(temperatures=[0.0], methods=["ngram"]), tmp_path, "fp", {"a": ["p"]}, [], [],
                      factory=factory)
    assert built == ["ngram"]
    (row,) = report.results
    assert (row.method, row.speedup, row.alpha) == ("ngram", None, 1.0) and row.tau == 3.0
    assert any("acceptance only" in n for n in report.config["notes"])
    files = write_outputs(report, tmp_path / "out", plots=False)
    assert not load_recommendations(tmp_path / "out" / "recommendations.yaml").choose("a", 0.0).speculate
    assert load_report(files.json).results[0].speedup is None
    assert load_settings("acceptance").eval.methods == ["drafts"]


def test_a_domain_can_have_its_own_prompt_count(tmp_path):
    """max_prompts_per_domain_of gives a domain of short answers more prompts; the others keep the default."""
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps({"domain": d, "prompt": f"{d} {i}"}) + "\n"
                            for d in ("chat", "prose") for i in range(6)))
    cfg = EvalConfig(max_prompts_per_domain=2, max_prompts_per_domain_of={"prose": 5})
    prompts, _ = group_prompts(load_prompt_records(path), [], cfg.prompts_of, "eval.jsonl")
    assert prompts == {"chat": ["chat 0", "chat 1"], "prose": [f"prose {i}" for i in range(5)]}


def test_tiny_engine_run_no_spec_and_ngram(tiny_target, prompts_file):
    """Our engine end to end on a tiny random Llama: rows for no-spec and n-gram with consistent figures."""
    prompts, skipped = group_prompts(load_prompt_records(prompts_file), [], lambda _: 1, "eval.jsonl")
    cfg = _cfg(temperatures=[0.0], repetitions=1, warmup=0, max_tokens=12, ignore_eos=True,
               engine=EngineSettings(kv_cache_memory_gb=0.02))
    report = run_eval(cfg, tiny_target, "fp", prompts, [], skipped)
    by = {(r.domain, r.method): r for r in report.results}
    assert {m for _, m in by} <= {"no-spec", "ngram"} and ("chat", "no-spec") in by
    base = by[("chat", "no-spec")]
    assert base.speedup == 1.0 and base.ms_per_token > 0 and base.ttft_p50 is not None
    assert 0 < base.target_time_share <= 1 and base.draft_time_share == 0.0
    # The tiny model gets the engine's auto counts (1 thread for small steps), and the report says so.
    assert any(n.startswith("torch intra-op threads: 1") and "num_threads=auto: small model" in n
               for n in report.config["notes"])
    ngram = by.get(("chat", "ngram"))
    if ngram is None:  # the speculative strategy is not in this checkout: then it must say so
        assert any(s.method == "ngram" for s in report.skipped)
    else:
        assert 0 <= ngram.alpha <= 1 and 1 <= ngram.tau <= 3 and len(ngram.a_k) <= 2
        assert ngram.speedup == pytest.approx(base.ms_per_token / ngram.ms_per_token)


def test_evaluate_entry_labels_rows_by_draft_key_and_skips_unloadable(tiny_target, prompts_file, tmp_path):
    """evaluate(): rows carry the caller's draft labels; a draft for another target's fingerprint loads
    (strict_fingerprint=False); one with another vocabulary is a SkippedEntry under its label."""
    old = _tiny_standalone(json.loads((tiny_target / "config.json").read_text()), tmp_path / "old")
    broken = _tiny_standalone({**TARGET_CFG, "vocab_size": 77}, tmp_path / "broken")
    report = harness.evaluate(
        target_dir=tiny_target, drafts={"old-standalone": old, "broken": broken}, domains=["code"], profile="quick",
        overrides=[f"eval.prompts={prompts_file}", "eval.max_tokens=4", "eval.warmup=0", "eval.ignore_eos=true",
                   "eval.engine.kv_cache_memory_gb=0.02", f"artifacts_root={tmp_path}", "train.max_steps=3"])
    assert report.config["num_speculative_tokens"] == [4] and report.config["max_prompts_per_domain"] == 4
    assert {r.domain for r in report.results} == {"code"}
    assert any(s.method == "broken" and "vocab_size" in s.reason for s in report.skipped)
    standalone_ready = importlib.util.find_spec("draftsmith.serve_eval.speculative.proposers.standalone") is not None
    if standalone_ready:
        assert any(r.method == "old-standalone" and r.K == 4 for r in report.results), report.skipped
    else:
        assert any(s.method == "old-standalone" and "cannot start" in s.reason for s in report.skipped)


def test_settings_profiles_and_bad_overrides():
    """Profiles follow their defaults chain; an override of the wrong type names the field."""
    s = load_settings("quick", ["eval.repetitions=2", "artifacts_root=/tmp/a", "data.anything=1"])
    assert (s.eval.name, s.eval.repetitions, s.eval.num_speculative_tokens, s.artifacts_root) == \
        ("quick", 2, [4], "/tmp/a")
    assert load_settings("gsm8k").eval.external_domains[0].domain == "gsm8k"
    with pytest.raises(ValueError, match="repetitions"):
        load_settings("default", ["eval.repetitions=many"])
    with pytest.raises(ValueError, match="eval.temperatures"):
        load_settings("default", ["eval.temperatures=[-1.0]"])
    with pytest.raises(ValueError, match="no-such-profile"):
        load_settings("no-such-profile")
    with pytest.raises(ValueError, match=r"eval.temperatures_of.ngram: \[0.7\] not in eval.temperatures"):
        load_settings("default", ["eval.temperatures=[0.0,1.0]", "eval.temperatures_of={ngram: [0.7]}"])
    with pytest.raises(ValueError, match=r"eval.max_prompts_per_domain_of.prose must be an int >= 1, got 0"):
        load_settings("default", ["eval.max_prompts_per_domain_of={prose: 0}"])
    with pytest.raises(ValueError, match=r"eval.num_speculative_tokens_of.ngram: a non-empty list of ints >= 1"):
        load_settings("default", ["eval.num_speculative_tokens_of={ngram: [0]}"])
    own = load_settings("default", ["eval.num_speculative_tokens_of={ngram: [8, 3]}"]).eval
    assert own.ks_of("ngram") == [3, 8] and own.ks_of("eagle") == [2, 4] and own.largest_k() == 8
    with pytest.raises(ValueError, match="temperatures_of.no-spec"):
        load_settings("default", ["eval.temperatures_of={no-spec: [0.0]}"])


def test_hydra_job_writes_report_under_target_fingerprint(tiny_target, prompts_file, tmp_path):
    """`draftsmith eval` composes conf/eval/default.yaml (typed by EvalConfig) and writes report.json,
    report.md and recommendations.yaml under <artifacts>/targets/<fingerprint>/reports/<stamp>/."""
    from draftsmith.drafts.identity import target_fingerprint
    from draftsmith.serve_eval.eval.run import run
    from draftsmith.train.config import compose

    cfg = compose([f"artifacts_root={tmp_path}", "wandb.mode=disabled", f"eval.target={tiny_target}",
                   f"eval.prompts={prompts_file}", "eval.methods=[no-spec]", "eval.domains=[code]",
                   "eval.max_prompts_per_domain=1", "eval.repetitions=1", "eval.warmup=0", "eval.max_tokens=4",
                   "eval.plots=false", "eval.engine.kv_cache_memory_gb=0.02"])
    out = run(cfg)
    assert out.parent == tmp_path / "targets" / target_fingerprint(tiny_target) / "reports"
    assert load_report(out).results[0].method == "no-spec"
    assert (out / "report.md").is_file() and (out / "recommendations.yaml").is_file()


def test_compare_subcommand_routes_to_compare_main(tmp_path, capsys):
    """`draftsmith eval compare A B` reaches compare.main (exit 0, deltas printed), not Hydra."""
    from draftsmith.serve_eval.eval.run import main

    def factory(plan: MethodPlan):
        return ScriptedRunner(plan.method, plan.K, {("a", 0.0): 10.0})

    report = run_eval(_cfg(temperatures=[0.0], methods=["no-spec"]), tmp_path, "fp", {"a": ["p"]}, [], [],
                      factory=factory)
    a = write_outputs(report, tmp_path / "A", plots=False).json
    b = write_outputs(report, tmp_path / "B", plots=False).json
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", str(a), str(b)])
    assert exit_info.value.code == 0
    assert "no-spec" in capsys.readouterr().out


def test_a_method_with_its_own_k_list_is_planned_at_those_k_only(tmp_path):
    """eval.num_speculative_tokens_of replaces the common K list for the methods it names."""
    cfg = EvalConfig(methods=["no-spec", "ngram"], num_speculative_tokens=[2, 4],
                     num_speculative_tokens_of={"ngram": [8]})
    plans = harness.plan_methods(cfg, [], tmp_path, [], [])
    assert [(p.method, p.K) for p in plans] == [("no-spec", 0), ("ngram", 8)]
