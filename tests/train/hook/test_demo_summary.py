"""The demonstration's figures on scripted records: per-cell intervals come from the reports, the recovered
share's interval brackets its point value and narrows with its cells', and the mean over seeds is the
mean of each seed's figures."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from demo_target_update_summary import over_seeds, render, render_over_seeds, share_interval, summarize, time_ratios
from draftsmith.serve_eval.eval.report import Report, ResultRow, TargetInfo
from draftsmith.serve_eval.eval.report_files import write_report


def report(path, alphas: dict[str, tuple[float, list[float]]]):
    rows = [ResultRow(domain=d, method="eagle", K=4, temperature=0.0, alpha=a, tau=2.0, a_k=[a] * 4,
                      ms_per_token=5.0, tokens_per_s=200.0, speedup=1.5, predicted_speedup=None, ttft_p50=None,
                      ttft_p99=None, itl_p50=None, itl_p99=None, draft_time_share=None, target_time_share=None,
                      repetitions=1, spread=0.0, alpha_ci=ci, num_prompts=32) for d, (a, ci) in alphas.items()]
    return str(write_report(Report(TargetInfo("t", "fp"), {}, rows), path, plots=False).json)


@pytest.fixture()
def record(tmp_path):
    old = report(tmp_path / "old", {"code": (0.60, [0.55, 0.65]), "chat": (0.50, [0.45, 0.55])})
    new = report(tmp_path / "new", {"code": (0.30, [0.25, 0.35]), "chat": (0.49, [0.44, 0.54])})
    cand = report(tmp_path / "cand", {"code": (0.57, [0.52, 0.62]), "chat": (0.50, [0.45, 0.55])})
    rec = {"drafts": [{"kind": "eagle", "regressed": ["code"], "report_new_target": new,
                       "candidate": {"report": cand},
                       "domains": {"code": {"old_target": 0.60, "new_target": 0.30, "candidate": 0.57},
                                   "chat": {"old_target": 0.50, "new_target": 0.49, "candidate": 0.50}}}]}
    return rec, {"eagle": {"old": old, "scratch": None}}


def test_cells_carry_their_reports_intervals_and_the_share_is_bracketed(record):
    rec, reports = record
    s = summarize(rec, None, 0.05, reports)
    code = next(r for r in s["rows"] if r["domain"] == "code")
    assert code["ci"]["old"] == [0.55, 0.65] and code["ci"]["new"] == [0.25, 0.35] and code["ci"]["cand"] == [0.52, 0.62]
    assert s["recovered_regressed"] == pytest.approx(0.9)
    low, high = s["recovered_regressed_ci"]
    assert low < 0.9 < high
    table = render({**s, "threshold": 0.05, "hook_exit": 0, "hook_outcome": "promoted", "hook_wall_s": 10.0,
                    "hook_timings_s": {}, "hook_steps": 5, "data_plan": {}, "eval_prompts": 32, "eval_tokens": 32})
    assert "0.600 [0.550, 0.650]" in table and "90% [" in table and "32 held-out prompts x 32 tokens" in table


@settings(max_examples=30, deadline=None)
@given(old=st.floats(0.5, 0.9), drop=st.floats(0.1, 0.4), back=st.floats(0.0, 1.0), width=st.floats(0.0, 0.05))
def test_share_interval_collapses_to_the_point_and_widens_with_its_cells(old, drop, back, width):
    new, cand = old - drop, old - drop + back * drop
    cells = lambda w: [((old, [old - w, old + w]), (new, [new - w, new + w]), (cand, [cand - w, cand + w]))]  # noqa: E731
    point = share_interval(cells(0.0))
    assert point == pytest.approx([back, back], abs=1e-9)
    low, high = share_interval(cells(width + 0.01))
    wider_low, wider_high = share_interval(cells(width + 0.03))
    assert low - 0.02 <= back <= high + 0.02 and wider_high - wider_low >= high - low
    assert share_interval([((old, None), (new, [0, 1]), (cand, [0, 1]))]) is None


def test_the_mean_over_seeds_is_each_figures_mean():
    def seed(i, recovered, hook_s, cand):
        return {"seed": i, "recovered_regressed": recovered, "recovered_regressed_ci": [recovered - 0.1, recovered + 0.1],
                "hook_wall_s": hook_s, "scratch": {"wall_s": 100.0},
                "rows": [{"kind": "eagle", "domain": "code", "old_draft_old_target": 0.6, "old_draft_new_target": 0.3,
                          "redistilled_new_target": cand, "scratch_new_target": None, "regressed": True}]}
    agg = over_seeds([seed(0, 0.8, 40.0, 0.54), seed(1, 0.9, 50.0, 0.57), seed(2, 1.0, 60.0, 0.60)])
    assert agg["recovered_regressed"] == pytest.approx(0.9) and agg["time_ratio"] == pytest.approx(0.5)
    (row,) = agg["rows"]
    assert row["redistilled_new_target"] == pytest.approx(0.57) and row["regressed_in"] == 3
    text = render_over_seeds(agg)
    assert "Mean over 3 seeds" in text and "seed 1: 90% [80%, 100%]" in text and "0.500" in text


def test_time_ratio_counts_both_sides_through_an_evaluated_draft():
    """Hook and scratch are each timed to an evaluated draft; the bare ratio drops every evaluation."""
    s = {"hook_wall_s": 100.0, "hook_timings_s": {"evaluate_old_drafts": 15.0, "evaluate_candidates": 10.0},
         "scratch": {"wall_s": 250.0, "evaluate_s": 10.0}}
    assert time_ratios(s) == pytest.approx((0.4, 75.0 / 240.0))
    assert over_seeds([{**s, "rows": [], "recovered_regressed": 1.0}])["time_ratio_without_evals"] == \
        pytest.approx(75.0 / 240.0)


def test_seeds_run_the_whole_flow_each_with_its_own_registry(tmp_path, monkeypatch, capsys):
    """--seeds 3: run_demo once per trainer seed, each in its own work dir and registry; the exit code
    holds over all seeds; the mean table is written beside them."""
    import json

    import demo_target_update as demo

    calls = []

    def fake_run_demo(cfg, extra=None):
        calls.append(cfg)
        return {"seed": cfg.seed, "recovered_regressed": 0.5 + 0.1 * cfg.seed, "recovered_regressed_ci": None,
                "hook_wall_s": 10.0, "scratch": {"wall_s": 40.0}, "hook_exit": 0, "rows": []}

    monkeypatch.setattr(demo, "run_demo", fake_run_demo)
    assert demo.main(["--seeds", "3", "--out", str(tmp_path / "w")]) == 0
    assert [c.seed for c in calls] == [0, 1, 2] and all(c.seeds == 1 for c in calls)
    assert len({c.registry for c in calls}) == 3 and all(c.registry.startswith(str(tmp_path / "w")) for c in calls)
    agg = json.loads((tmp_path / "w" / "summary.json").read_text())
    assert agg["recovered_regressed"] == pytest.approx(0.6) and agg["time_ratio"] == pytest.approx(0.25)
    assert "Mean over 3 seeds" in capsys.readouterr().out
