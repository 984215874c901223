"""`draftsmith plan --draft-dtype int8|int4 [--alpha-cost-from bench_quant.json]`."""

from __future__ import annotations

import json

import pytest

from serve_eval.plan.cli import main
from serve_eval.plan.estimate import DraftOptions, Hardware, TargetSpec, Workload, make_plan
from serve_eval.plan.quant import quantized_alphas

TARGET = TargetSpec(70e9, 80, 8, 128, 8192, 128256)


def _rows(**opts):
    plan = make_plan(TARGET, Hardware(), Workload(), DraftOptions(standalone_params=7e9, **opts))
    return {r.strategy: r for r in plan.strategies}


def test_an_int4_draft_weighs_a_quarter_of_a_bf16_one_and_costs_less_per_round():
    bf16, int4 = _rows(), _rows(draft_dtype_bytes=0.5)
    for name in ("standalone", "eagle", "medusa"):
        assert int4[name].draft_gb_per_gpu == pytest.approx(bf16[name].draft_gb_per_gpu / 4)
        assert int4[name].draft_cost_ms < bf16[name].draft_cost_ms


def test_measured_alpha_cost_replaces_the_assumption(tmp_path):
    figures = tmp_path / "bench.json"
    figures.write_text(json.dumps({"acceptance": {
        "standalone/bf16": {"chat": [0.60, 2.4], "code": [0.50, 2.0]},
        "standalone/int4-g64": {"chat": [0.55, 2.2], "code": [0.47, 1.9]},
        "standalone/int8": {"chat": [0.60, 2.4], "code": [0.50, 2.0]}}}))
    alphas, notes = quantized_alphas({"standalone": 0.8, "eagle": 0.7}, "int4", figures)
    assert alphas["standalone"] == pytest.approx(0.8 - 0.04)  # mean of 5 and 3 points
    assert alphas["eagle"] == pytest.approx(0.7 - 0.04)  # not measured: the seed's assumption
    assert any("measured" in n and "standalone" in n for n in notes)
    assert any("assumed" in n and "eagle" in n for n in notes)
    assert quantized_alphas({"standalone": 0.8}, "int8", figures)[0]["standalone"] == pytest.approx(0.8)


def test_alpha_cost_needs_a_quantized_draft_dtype(tmp_path, capsys):
    code = main(["--params", "7e9", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--hidden", "4096",
                 "--vocab", "32000", "--alpha-cost-from", str(tmp_path / "x.json")])
    assert code == 2
    assert "--alpha-cost-from needs --draft-dtype in ['int8', 'int4']" in capsys.readouterr().err
