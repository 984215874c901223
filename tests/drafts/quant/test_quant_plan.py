"""`draftsmith plan --draft-dtype int8|int4 [--alpha-cost-from bench_quant.json]`."""

from __future__ import annotations

import json

import pytest

from draftsmith.serve_eval.plan.cli import main
from draftsmith.serve_eval.plan.estimate import DraftOptions, Hardware, TargetSpec, Workload, make_plan
from draftsmith.serve_eval.plan.quant import quantized_alphas

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


def _report_row(domain, method, alpha, quantization=None, variant_of=None):
    from draftsmith.serve_eval.eval.report import ResultRow

    return ResultRow(domain=domain, method=method, K=4, temperature=0.0, alpha=alpha, tau=1 + 4 * alpha, a_k=[],
                     ms_per_token=5.0, tokens_per_s=1.0, speedup=1.5, predicted_speedup=None, ttft_p50=None,
                     ttft_p99=None, itl_p50=None, itl_p99=None, draft_time_share=None, target_time_share=None,
                     repetitions=3, spread=0.0, quantization=quantization, variant_of=variant_of)


def _scripted_report(tmp_path):
    """An eval report: standalone and its int4 variant in two domains (5 and 3 points lost), eagle3 and its int8."""
    from draftsmith.serve_eval.eval.report import Report, TargetInfo
    from draftsmith.serve_eval.eval.report_files import write_report

    rows = [_report_row("chat", "standalone", 0.60), _report_row("chat", "standalone@int4-g64", 0.55, "int4-g64",
                                                                "standalone"),
            _report_row("code", "standalone", 0.50), _report_row("code", "standalone@int4-g64", 0.47, "int4-g64",
                                                                "standalone"),
            _report_row("chat", "e3", 0.70), _report_row("chat", "e3@int8", 0.69, "int8", "e3")]
    report = Report(TargetInfo("/t", "fp"), {"draft_kinds": {"standalone": "standalone", "e3": "eagle3"}}, rows)
    return write_report(report, tmp_path / "report", plots=False).json


def test_an_eval_report_gives_the_measured_alpha_cost_and_the_plan_says_so(tmp_path, capsys):
    path = _scripted_report(tmp_path)
    alphas, notes = quantized_alphas({"standalone": 0.8, "eagle": 0.7, "medusa": 0.6}, "int4", None, report=path)
    assert alphas["standalone"] == pytest.approx(0.8 - 0.04)   # mean of 5 and 3 points, measured
    assert alphas["eagle"] == pytest.approx(0.7 - 0.04)        # no int4 eagle variant: the assumption
    assert any(n.startswith("standalone:") and f"measured in eval report {path}" in n for n in notes)
    assert any(n.startswith("eagle:") and "assumed" in n and "measures no int4 variant" in n for n in notes)
    int8, _ = quantized_alphas({"eagle": 0.7}, "int8", None, report=path.parent)   # the dir works too
    assert int8["eagle"] == pytest.approx(0.69)                 # the eagle3 row (kind from the report)
    code = main(["--params", "7e9", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--hidden", "4096",
                 "--vocab", "32000", "--standalone-params", "1e9", "--draft-dtype", "int4", "--report", str(path),
                 "--json"])
    assert code == 0
    plan = json.loads(capsys.readouterr().out)
    assert any("measured in eval report" in n for n in plan["notes"])


def test_bad_report_input_is_one_line(tmp_path, capsys):
    args = ["--params", "7e9", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--hidden", "4096",
            "--vocab", "32000", "--draft-dtype", "int4"]
    assert main([*args, "--report", str(tmp_path / "none.json")]) == 2
    assert "--report: no report at" in capsys.readouterr().err
    path = _scripted_report(tmp_path)
    assert main([*args, "--report", str(path), "--alpha-cost-from", str(path)]) == 2
    assert "give one source of measured alpha costs" in capsys.readouterr().err
