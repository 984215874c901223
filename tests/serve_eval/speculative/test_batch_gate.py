"""The batch-size gate on scripted step costs: speculation where it pays, plain decoding where it does not."""
from __future__ import annotations

import pytest

from draftsmith.serve_eval.speculative.batch_gate import BatchGate, BatchGateConfig


def run(gate: BatchGate, batch_size: int, steps: int, spec_ms_per_token: float, plain_ms_per_token: float) -> float:
    """Drive the gate for `steps` steps with scripted costs per token (every speculative arm costs
    `spec_ms_per_token`); returns the share of speculative steps."""
    speculative = 0
    for _ in range(steps):
        spec = gate.cap(batch_size) != 0
        speculative += spec
        ms = spec_ms_per_token if spec else plain_ms_per_token
        gate.observe_step(batch_size, spec, ms * batch_size / 1000, batch_size)
    return speculative / steps


def mean_cost(gate: BatchGate, batch_size: int, steps: int, costs: dict[int | None, float]) -> float:
    """Mean scripted ms per token over `steps` steps; `costs` maps each cap (None: uncapped, 0: plain) to its cost."""
    total = 0.0
    for _ in range(steps):
        cap = gate.cap(batch_size)
        total += costs[cap]
        gate.observe_step(batch_size, cap != 0, costs[cap] * batch_size / 1000, batch_size)
    return total / steps


def chosen_caps(gate: BatchGate, batch_size: int, steps: int, costs: dict[int | None, float],
                spike_every: int = 0) -> list[int | None]:
    """The cap of each of `steps` scripted steps (`costs` as in mean_cost); with spike_every, every such step
    costs 4x whatever arm runs it."""
    chosen = []
    for step in range(steps):
        cap = gate.cap(batch_size)
        chosen.append(cap)
        spike = 4.0 if spike_every and step % spike_every == 3 else 1.0
        gate.observe_step(batch_size, cap != 0, costs[cap] * spike * batch_size / 1000, batch_size)
    return chosen


def test_measured_gate_speculates_at_batch_1_and_decodes_plainly_at_batch_16():
    """Scripted: at batch 1 a speculative step costs 0.6 of plain per token, at batch 16 1.4x. The gate
    settles on speculation at 1 and on plain decoding at 16, exploring the other arms 1 step in 16 or fewer."""
    gate = BatchGate()
    assert run(gate, 1, 400, spec_ms_per_token=3.0, plain_ms_per_token=5.0) > 0.9
    assert run(gate, 16, 400, spec_ms_per_token=1.4, plain_ms_per_token=1.0) < 0.1
    assert gate.cap(1) is None and gate.cap(16) == 0
    assert gate.to_dict()["16"]["speculate"] is False


def test_measured_gate_settles_on_the_cheapest_k_cap():
    """Scripted from the embedded target at batch 16: K=4 rounds 1.22x plain per token, K <= 1 0.98x,
    K <= 2 1.01x. The gate settles on K <= 1, and its mean cost beats plain decoding's despite exploring;
    at batch 1, where the uncapped K is cheapest, it keeps it."""
    gate = BatchGate()
    costs = {None: 1.22, 1: 0.98, 2: 1.01, 0: 1.0}
    assert mean_cost(gate, 16, 3000, costs) < 1.0
    assert gate.cap(16) == 1 and gate.to_dict()["16"]["cap"] == 1
    batch1 = {None: 0.6, 1: 0.8, 2: 0.7, 0: 1.0}
    assert mean_cost(gate, 1, 1000, batch1) < 0.65
    assert chosen_caps(gate, 1, 200, batch1).count(None) > 180   # the uncapped K, but for its re-tries


def test_the_measured_gate_follows_a_change_of_costs():
    gate = BatchGate(BatchGateConfig(explore_every=8))
    run(gate, 4, 200, spec_ms_per_token=2.0, plain_ms_per_token=3.0)
    assert gate.cap(4) is None
    assert run(gate, 4, 300, spec_ms_per_token=4.0, plain_ms_per_token=3.0) < 0.25   # the draft got slower
    assert gate.cap(4) == 0


def test_the_expected_cost_is_never_above_plain_decoding_by_more_than_exploration():
    """Over any scripted cost pair, the gate's mean cost per token stays within the exploration share
    of the better arm."""
    for spec_ms, plain_ms in [(1.0, 2.0), (2.0, 1.0), (1.0, 1.05), (3.0, 1.0)]:
        gate = BatchGate()
        steps = 800
        share = run(gate, 8, steps, spec_ms, plain_ms)
        mean = share * spec_ms + (1 - share) * plain_ms
        assert mean <= min(spec_ms, plain_ms) * 1.0 + abs(spec_ms - plain_ms) * (1 / 16 + 6 / steps) + 1e-9


def test_table_mode_caps_k_by_batch_size_and_bad_settings_are_refused():
    gate = BatchGate(BatchGateConfig(mode="table", k_by_batch_size={1: 4, 8: 2, 16: 0}))
    assert [gate.cap(b) for b in (1, 2, 8, 9, 16, 64)] == [4, 2, 2, 0, 0, 0]
    assert BatchGate(BatchGateConfig(mode="off")).cap(32) is None
    with pytest.raises(ValueError, match="batch_gate.mode"):
        BatchGateConfig(mode="sometimes")
    with pytest.raises(ValueError, match="k_by_batch_size"):
        BatchGateConfig(mode="table")
    with pytest.raises(ValueError, match="k_caps"):
        BatchGateConfig(k_caps=(0, 2))


def test_the_engine_applies_the_gate_and_greedy_output_is_unchanged(tmp_path):
    """Inside the engine: a table that allows no speculation at batch <= 8 runs no round for 4 requests,
    one allowing K <= 2 runs rounds of at most 2 draft tokens, and the greedy outputs equal plain
    decoding's either way."""
    from draftsmith.serve_eval.engine import EngineConfig, LLMEngine, SamplingParams
    from draftsmith.serve_eval.speculative.config import SpecConfig
    from spec_helpers import greedy_reference, make_llama, run_engine, workload

    target = make_llama(tmp_path / "target")
    prompts, lengths = workload(4, seed=3)
    reference = greedy_reference(target, prompts, lengths)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    for table, max_k in (({8: 0}, 0), ({8: 2}, 2)):
        spec = SpecConfig("ngram", num_speculative_tokens=4,
                          batch_gate=BatchGateConfig(mode="table", k_by_batch_size=table))
        engine = LLMEngine(EngineConfig(str(target)), speculative=spec)
        outputs = run_engine(engine, prompts, params)
        assert {rid: out.output_token_ids for rid, out in outputs.items()} == reference
        total = engine.strategy.metrics.total
        if max_k == 0:
            assert total.num_rounds == 0
        else:
            assert total.num_rounds > 0 and len(total.proposed_by_position) <= max_k


def test_re_tries_of_a_losing_arm_back_off_and_still_catch_it_getting_better():
    """Speculation 1.4x dearer per token at batch 32: each re-try that confirms plain decoding doubles that arm's
    interval, so over 3,000 steps the losing arms together run well under 1/16 of them and cost under the 1%
    overhead budget; when the draft then gets cheap (0.6x, every speculative arm alike), a re-try within
    max_explore_every steps sees it and the gate speculates again."""
    gate = BatchGate()
    share = run(gate, 32, 3000, spec_ms_per_token=1.4, plain_ms_per_token=1.0)
    assert share * (1.4 - 1.0) < gate.config.explore_overhead, share
    assert gate.cap(32) == 0
    share = run(gate, 32, 600, spec_ms_per_token=0.6, plain_ms_per_token=1.0)
    assert gate.cap(32) != 0 and share > 0.4, share


def test_cost_spikes_neither_promote_nor_bury_an_arm():
    """Plain decoding is cheapest (K=4 1.22x, K <= 1 1.05x, K <= 2 1.08x per token), but every 7th step
    costs 4x whatever arm runs it, as a busy shared CPU does. The gate still decodes plainly nearly all
    the time: no spike on a re-try makes plain decoding look dear or a speculative cap look cheap."""
    gate = BatchGate()
    costs = {None: 1.22, 1: 1.05, 2: 1.08, 0: 1.0}
    chosen = chosen_caps(gate, 16, 3000, costs, spike_every=7)
    assert chosen[-1000:].count(0) / 1000 > 0.97
    assert sum(costs[c] for c in chosen[-1000:]) / 1000 < 1.01


def test_a_large_batch_never_runs_its_dearest_arms_before_k_1_has_lost():
    """Scripted at batch 32, costs growing with K (K <= 1 1.1x plain per token, K <= 2 1.2x, K=4 1.4x): plain
    decoding and K <= 1 are measured first, the larger Ks are presumed to lose and run only on their re-tries,
    so the first 16 steps cost 1.02x plain decoding (measuring the uncapped arm first cost 1.13x)."""
    gate = BatchGate()
    costs = {None: 1.4, 1: 1.1, 2: 1.2, 0: 1.0}
    chosen = chosen_caps(gate, 32, 16, costs)
    assert chosen[:6] == [0, 0, 0, 1, 1, 1] and set(chosen[6:]) == {0}
    assert gate.to_dict()["32"]["presumed"] == ["uncapped", "k<=2"]
    assert sum(costs[c] for c in chosen) / 16 < 1.04
    assert mean_cost(gate, 32, 2000, costs) < 1.02


def test_a_presumed_loser_that_would_win_is_found_by_its_re_try():
    """The presumption is only a prior: where K <= 1 loses but the uncapped K pays (acceptance high enough for
    long rounds), the uncapped arm's re-try measures it and the gate settles on it; at batch 1, where K <= 1
    already wins, every arm is measured."""
    gate = BatchGate()
    costs = {None: 0.7, 1: 1.05, 2: 0.9, 0: 1.0}
    mean_cost(gate, 8, 800, costs)
    assert gate.cap(8) is None and gate.to_dict()["8"]["presumed"] == []
    small = BatchGate()
    # 3 steps of each arm, then 3 fresh steps of plain decoding before the first speculative win stands
    mean_cost(small, 1, 15, {None: 0.5, 1: 0.8, 2: 0.6, 0: 1.0})
    assert small.to_dict()["1"]["presumed"] == [] and small.cap(1) is None


def test_a_presumed_arms_first_re_try_is_a_full_burst():
    """A presumed arm's first run is never a single step: its re-try runs min_samples steps, so its estimate is a
    median like every other arm's (one spike on that step cannot bury it)."""
    gate = BatchGate()
    costs = {None: 1.4, 1: 1.1, 2: 1.2, 0: 1.0}
    chosen = chosen_caps(gate, 32, 200, costs)
    for arm in (None, 2):
        first = chosen.index(arm)
        assert chosen[first:first + 3] == [arm] * 3, (arm, chosen[first - 1:first + 4])


def test_re_tries_cost_at_most_their_overhead_budget_and_a_cheap_one_is_not_held_up():
    """Plain decoding wins by far (K <= 1 1.5x, K <= 2 1.8x, uncapped 2.5x per token): after the first measurements
    the re-tries cost at most about explore_overhead (1%) over plain decoding, where re-trying each arm at the
    interval alone cost several times that. A near-winner (K <= 1 at 1.02x) beside dear arms is re-tried first in
    each turn, not after them."""
    gate = BatchGate()
    costs = {None: 2.5, 1: 1.5, 2: 1.8, 0: 1.0}
    mean_cost(gate, 16, 200, costs)
    assert mean_cost(gate, 16, 3000, costs) < 1.0 * (1 + 0.015)
    near = BatchGate()
    chosen = chosen_caps(near, 16, 400, {None: 2.5, 1: 1.02, 2: 1.8, 0: 1.0})
    retries = [(i, cap) for i, cap in enumerate(chosen) if i >= 6 and cap != 0]
    assert sum(cap == 1 for _, cap in retries) >= 3
    # once every arm has run (the dear ones were presumed as cheap as K <= 1 until then), K <= 1 leads each turn
    later = [cap for i, cap in retries if i > 60]
    assert later and later[0] == 1


def test_a_draft_that_catches_up_after_plain_steps_is_re_tried_by_what_its_re_tries_really_cost():
    """A standalone draft runs only while speculating, so a speculative step after a stretch of plain decoding
    first catches the draft up on every token since, up to the batch's live context (here 0.05x a plain step per
    plain step skipped, at most 200 of them: a re-try costs up to 10 plain steps on top; at batch 16 on the
    embedded target one cost ~3), while its steady rounds cost 1.5x per token. Median per-token costs hide that
    one dear step, so re-tries timed by them (every 256 steps at most) cost ~4%; timed by what the arm's last
    re-try really cost beyond the winner, they stay within about the overhead budget."""
    gate = BatchGate()
    batch, plain_ms, steady_spec_ms, catch_up_ms, live_context = 16, 1.0, 1.5, 0.05 * 16, 200
    since_spec = 0

    def step() -> tuple[float, bool]:
        nonlocal since_spec
        spec = gate.cap(batch) != 0
        ms = steady_spec_ms * batch + catch_up_ms * min(since_spec, live_context) if spec else plain_ms * batch
        since_spec = 0 if spec else since_spec + 1
        gate.observe_step(batch, spec, ms / 1000, batch)
        return ms, spec

    for _ in range(600):   # the first measurements and the first turns of re-tries
        step()
    steps = [step() for _ in range(6000)]
    assert sum(ms for ms, _ in steps) < plain_ms * batch * len(steps) * (1 + 0.015)
    assert any(spec for _, spec in steps)   # the dear arms are still re-tried


def test_a_new_buckets_first_hundreds_of_steps_cost_little_more_than_the_budget():
    """A batch-16 bucket from its first step, as a benchmark of a few hundred steps sees it: K <= 1 1.85x dearer per
    token than plain decoding (the larger Ks dearer still), and a speculative step after plain ones catching the
    draft up (up to 3 plain steps' worth, as at batch 16 on the embedded target). The presumed arms wait for what
    K <= 1's re-try showed their first step costs, so 768 steps cost at most 1.5% over plain decoding (with a turn
    of re-tries every 256 steps and the presumed arms due by that interval: 3%)."""
    gate = BatchGate()
    batch, ratio, catch_up_per_step, live_context = 16, 1.85, 3 / 128, 128
    costs = {1: ratio, 2: ratio * 1.3, None: ratio * 1.8, 0: 1.0}
    since_spec, total = 0, 0.0
    for _ in range(768):
        cap = gate.cap(batch)
        spec = cap != 0
        ms = (costs[cap] + catch_up_per_step * min(since_spec, live_context)) * batch if spec else batch
        since_spec = 0 if spec else since_spec + 1
        gate.observe_step(batch, spec, ms / 1000, batch)
        total += ms
    assert total / (768 * batch) < 1.015


def test_a_drafts_start_cost_times_the_first_re_try():
    """A speculative arm's first step pays the draft's start (its catch-up over every prompt: 12 plain steps' worth,
    as at batch 16 on the embedded target) and its re-tries a catch-up over every token since (up to 10 plain
    steps' worth). That start cost times the first re-try, so the 512 steps after a 128-step warm-up (a benchmark's
    window) decode plainly at plain decoding's cost; timed by the per-token medians alone, K <= 1 (1.45x dearer) was
    re-tried at once and the window cost 2% more."""
    gate = BatchGate()
    batch, start_steps, catch_up_per_step, live_context = 16, 12.0, 10 / 128, 128
    costs = {1: 1.45, 2: 1.45 * 1.6, None: 1.45 * 3, 0: 1.0}
    since_spec, started, window = 0, False, []
    for step in range(128 + 512):
        cap = gate.cap(batch)
        spec = cap != 0
        extra = (catch_up_per_step * min(since_spec, live_context) if started else start_steps) if spec else 0.0
        started = started or spec
        ms = (costs[cap] + extra) * batch
        since_spec = 0 if spec else since_spec + 1
        gate.observe_step(batch, spec, ms / 1000, batch)
        if step >= 128:
            window.append(ms)
    assert sum(window) / (len(window) * batch) < 1.005
    # ... and it is still re-tried, at most max_retry_wait steps later
    assert any(gate.cap(batch) != 0 or gate.observe_step(batch, False, batch / 1000, batch) for _ in range(2100))


def test_a_re_try_that_caught_up_on_little_does_not_hurry_the_next():
    """Re-tries pay the draft's catch-up over every token since the last speculative step of any arm, so one that
    follows a sibling's closely is cheap, and timing the next re-try by it would re-try that arm within a few hundred
    steps. Every speculative arm's next re-try is timed by the dearest recent catch-up of the bucket's one draft (its
    start included): over 6000 scripted steps of batch 16 no arm is re-tried twice within 1000 steps."""
    gate = BatchGate()
    batch, costs = 16, {1: 1.15, 2: 1.3, None: 2.5, 0: 1.0}
    since_spec, started, previous, runs = 0, False, 0, {1: [], 2: [], None: []}
    for step in range(6000):
        cap = gate.cap(batch)
        spec = cap != 0
        extra = (0.07 * min(since_spec, 160) if started else 12.0) if spec else 0.0
        started = started or spec
        if spec and cap != previous:      # the first step of an arm's run
            runs[cap].append(step)
        previous = cap
        since_spec = 0 if spec else since_spec + 1
        gate.observe_step(batch, spec, (costs[cap] + extra) * batch / 1000, batch)
    for cap, starts in runs.items():
        gaps = [b - a for a, b in zip(starts, starts[1:]) if a > 10]   # after the first measurement
        assert gaps and min(gaps) > 1000, (cap, starts)                 # every arm is still re-tried, seldom


def test_the_policy_measures_c_only_on_rounds_whose_draft_was_caught_up(tmp_path):
    """The first speculative step after plain decoding carries the draft's catch-up over every token since (at batch
    16 its c was ~3.5 against 0.13 after it), so the engine feeds the policy c only from steps that follow a step
    with rounds; greedy output is unchanged."""
    from draftsmith.serve_eval.engine import EngineConfig, LLMEngine, SamplingParams
    from draftsmith.serve_eval.speculative.config import SpecConfig
    from spec_helpers import greedy_reference, make_llama, run_engine, workload

    target = make_llama(tmp_path / "target")
    prompts, lengths = workload(4, seed=5)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    spec = SpecConfig("ngram", num_speculative_tokens=2, batch_gate=BatchGateConfig(mode="table", k_by_batch_size={8: 2}))
    engine = LLMEngine(EngineConfig(str(target)), speculative=spec)
    strategy, log = engine.strategy, []
    record, observe = strategy._record, strategy.policy.observe_cost_ratio
    strategy._record = lambda engine, out, drafts, results, *rest: (log.append(("step", bool(results))),
                                                                     record(engine, out, drafts, results, *rest))[1]
    strategy.policy.observe_cost_ratio = lambda c: (log.append(("c", c)), observe(c))[1]
    outputs = run_engine(engine, prompts, params)
    assert {rid: out.output_token_ids for rid, out in outputs.items()} == greedy_reference(target, prompts, lengths)
    steps = [rounds for kind, rounds in log if kind == "step"]
    measured = [i for i, (kind, _) in enumerate(log) if kind == "c"]
    assert sum(steps) >= 3 and measured
    for i in measured:   # each c follows its own step's record, and that step and the one before it ran rounds
        own = sum(kind == "step" for kind, _ in log[:i]) - 1
        assert steps[own] and own > 0 and steps[own - 1]
    caught_up = sum(1 for before, now in zip(steps, steps[1:]) if before and now)
    assert len(measured) == caught_up



def test_a_load_that_drifts_under_the_gate_does_not_promote_a_dearer_arm():
    """Waves of long and short contexts alternate (every arm 1.7x dearer per token in a long wave, as at batch 16
    on the embedded target's two halves of the eval prompts), while K <= 1 costs 1.2x plain decoding throughout.
    Each arm's window dates from when it last ran, so a re-try in a short wave beat plain decoding's window from
    a long one; checked against fresh plain steps, speculation never wins, and the gate's cost stays within its
    exploration budget of plain decoding's at the same moments."""
    gate = BatchGate()
    costs = {None: 1.5, 1: 1.2, 2: 1.35, 0: 1.0}
    total = plain = 0.0
    caps = []
    for step in range(3000):
        wave = 1.7 if (step // 40) % 2 == 0 else 1.0
        cap = gate.cap(16)
        caps.append(cap)
        total += costs[cap] * wave
        plain += costs[0] * wave
        gate.observe_step(16, cap != 0, costs[cap] * wave * 16 / 1000, 16)
    # (windows alone: 1.024 and 934 plain steps of the last 1000, K <= 1 and the uncapped K run for whole waves)
    assert total / plain < 1.015
    assert caps[-1000:].count(0) > 960
