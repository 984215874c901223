"""A looping target is flagged: the distinct-4-gram share of a cell's outputs, its note, its report field."""
from __future__ import annotations

import json

import pytest

from draftsmith.serve_eval.eval.report import ReportSchemaError, load_report
from draftsmith.serve_eval.eval.rows import LOOP_SHARE, distinct_ngram_share, looping_cells
from draftsmith.serve_eval.eval.runners import RequestRecord, RunResult
from test_report import make_row, scripted_report


def _run(*outputs: list[int]) -> RunResult:
    return RunResult([RequestRecord(len(ids), None, [], None, list(ids)) for ids in outputs], 1.0)


def test_distinct_share_of_known_outputs():
    """No repeated 4-gram: 1.0; one token repeated 20 times: 1 of 17 4-grams; a 3-token cycle over 12 tokens:
    3 of 9; averaged over outputs and repetitions; None without token ids or with outputs under 4 tokens."""
    assert distinct_ngram_share([_run(list(range(10)))]) == 1.0
    assert distinct_ngram_share([_run([7] * 20)]) == pytest.approx(1 / 17)
    assert distinct_ngram_share([_run([1, 2, 3] * 4)]) == pytest.approx(3 / 9)
    assert distinct_ngram_share([_run(list(range(10))), _run([7] * 20)]) == pytest.approx((1 + 1 / 17) / 2)
    assert distinct_ngram_share([_run([], [1, 2, 3])]) is None


def test_only_looping_baselines_get_a_note():
    """A no-spec cell below LOOP_SHARE gets one line naming its domain and temperature; a draft's row, a
    baseline above the share and one without ids get none."""
    rows = [make_row("chat", "no-spec", distinct_4gram_share=0.02),
            make_row("chat", "no-spec", temperature=1.0, distinct_4gram_share=1.0),
            make_row("code", "no-spec", distinct_4gram_share=LOOP_SHARE + 0.01),
            make_row("prose", "no-spec"),
            make_row("math", "eagle", 4, distinct_4gram_share=0.01)]
    (line,) = looping_cells(rows)
    assert line.startswith("loop: chat T=0: the target's answers repeat (distinct 4-grams 0.02 of all")


def test_report_keeps_the_share_and_refuses_one_out_of_range(tmp_path):
    rep = scripted_report()
    rep.results[0].distinct_4gram_share = 0.25
    path = tmp_path / "report.json"
    path.write_text(json.dumps(rep.to_dict()))
    assert load_report(path).results[0].distinct_4gram_share == 0.25
    data = rep.to_dict()
    data["results"][0]["distinct_4gram_share"] = 1.5
    path.write_text(json.dumps(data))
    with pytest.raises(ReportSchemaError, match=r"distinct_4gram_share must be null or in \[0, 1\], got 1.5"):
        load_report(path)
