"""`draftsmith eval compare A B`: exact deltas on scripted reports, unmatched rows, schema mismatch."""
from __future__ import annotations

import json

import pytest

from draftsmith.serve_eval.eval.compare import compare, main
from draftsmith.serve_eval.eval.report import SCHEMA_VERSION, Report, ReportSchemaError, ResultRow, TargetInfo
from draftsmith.serve_eval.eval.report_files import write_report


def row(domain, method, K, T=0.0, alpha=None, tau=None, ms=10.0, speedup=None) -> ResultRow:
    return ResultRow(domain=domain, method=method, K=K, temperature=T, alpha=alpha, tau=tau, a_k=[],
                     ms_per_token=ms, tokens_per_s=1000 / ms, speedup=speedup, predicted_speedup=None,
                     ttft_p50=None, ttft_p99=None, itl_p50=None, itl_p99=None, draft_time_share=None,
                     target_time_share=None, repetitions=1, spread=0.0)


# Values are dyadic fractions, so B - A is exact in floating point and can be checked with ==.
A = Report(TargetInfo("t", "fp-old"), {}, [
    row("code", "no-spec", 0, ms=20.0, speedup=1.0),
    row("code", "eagle", 4, alpha=0.5, tau=3.0, ms=10.0, speedup=2.0),
    row("chat", "eagle", 4, T=1.0, alpha=0.75, tau=4.0, ms=8.0, speedup=2.5),
    row("math", "medusa", 2, alpha=0.25, tau=1.5, ms=16.0, speedup=1.25),
])
B = Report(TargetInfo("t", "fp-new"), {}, [
    row("code", "no-spec", 0, ms=21.0, speedup=1.0),
    row("code", "eagle", 4, alpha=0.75, tau=4.0, ms=7.5, speedup=2.75),
    row("chat", "eagle", 4, T=1.0, alpha=0.625, tau=3.5, ms=9.0, speedup=2.25),
    row("prose", "eagle", 4, alpha=0.5, tau=3.0, ms=10.0, speedup=2.0),
])


def test_deltas_are_b_minus_a_exactly():
    """Every metric delta equals B - A for rows matched on (domain, method, K, temperature)."""
    cmp = compare(A, B)
    eagle = cmp.get("code", "eagle", 4, 0.0).metrics
    assert (eagle["alpha"].delta, eagle["tau"].delta, eagle["ms_per_token"].delta, eagle["speedup"].delta) == \
        (0.25, 1.0, -2.5, 0.75)
    chat = cmp.get("chat", "eagle", 4, 1.0).metrics
    assert (chat["alpha"].delta, chat["tau"].delta, chat["ms_per_token"].delta, chat["speedup"].delta) == \
        (-0.125, -0.5, 1.0, -0.25)
    base = cmp.get("code", "no-spec", 0, 0.0).metrics
    assert base["alpha"].delta is None and base["ms_per_token"].delta == 1.0  # no-spec has no alpha
    assert cmp.only_in_a == [("math", "medusa", 2, 0.0)]
    assert cmp.only_in_b == [("prose", "eagle", 4, 0.0)]
    assert any("fp-old" in n and "fp-new" in n for n in cmp.notes)


def test_compare_reads_files_and_cli_prints_table(tmp_path, capsys, monkeypatch):
    """compare() accepts report paths; the CLI prints the deltas and the unmatched rows."""
    monkeypatch.setenv("COLUMNS", "200")  # rich would wrap the cells at the captured 80 columns
    write_report(A, tmp_path / "a", plots=False)
    write_report(B, tmp_path / "b", plots=False)
    cmp = compare(tmp_path / "a" / "report.json", tmp_path / "b")
    assert cmp.get("code", "eagle", 4, 0.0).metrics["speedup"].delta == 0.75
    assert main([str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "0.500 -> 0.750 (+0.250)" in out
    assert "only in A: domain=math method=medusa K=2" in out
    assert "only in B: domain=prose method=eagle K=4" in out


def test_other_schema_version_gives_clear_message(tmp_path, capsys):
    """A report of another schema version: compare() raises naming report B, the CLI exits 2 with it."""
    write_report(A, tmp_path / "a", plots=False)
    data = B.to_dict()
    data["schema_version"] = SCHEMA_VERSION + 1
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "report.json").write_text(json.dumps(data))
    with pytest.raises(ReportSchemaError, match=r"report B: .*schema_version is 2"):
        compare(tmp_path / "a", tmp_path / "b")
    assert main([str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "report B" in err and "schema_version" in err
    odd = Report(TargetInfo("t", "f"), {}, [], schema_version=SCHEMA_VERSION + 1)
    with pytest.raises(ReportSchemaError, match="same schema"):
        compare(A, odd)
