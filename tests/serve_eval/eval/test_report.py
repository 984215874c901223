"""report.json / report.md / PNG plots / W&B logging on scripted results with known values."""
from __future__ import annotations

import json
import os

import pytest

from draftsmith.serve_eval.eval.recommend import recommend
from draftsmith.serve_eval.eval.report import (SCHEMA_VERSION, Report, ReportSchemaError, ResultRow, SkippedEntry, TargetInfo,
                                    load_report)
from draftsmith.serve_eval.eval.report_files import log_to_wandb, render_markdown, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_row(domain: str, method: str, K: int = 0, temperature: float = 0.0, **kw) -> ResultRow:
    spec = method != "no-spec"
    base = dict(alpha=0.75 if spec else None, tau=1 + K * 0.75 if spec else None,
                a_k=[0.9, 0.8, 0.7, 0.6][:K] if spec else [], ms_per_token=10.0 if spec else 20.0,
                tokens_per_s=100.0 if spec else 50.0, speedup=2.0 if spec else 1.0,
                predicted_speedup=2.2 if spec else None, ttft_p50=0.05, ttft_p99=0.08, itl_p50=0.01, itl_p99=0.03,
                draft_time_share=0.2 if spec else None, target_time_share=0.7 if spec else 0.95,
                repetitions=3, spread=0.5, ms_per_token_samples=[9.5, 10.0, 10.5] if spec else [19.5, 20.0, 20.5])
    base.update(kw)
    return ResultRow(domain=domain, method=method, K=K, temperature=temperature, **base)


def scripted_report() -> Report:
    results = [make_row("code", "no-spec"), make_row("code", "eagle", 3), make_row("code", "eagle", 4, alpha=0.7),
               make_row("code", "ngram", 3, alpha=0.4, speedup=0.9),
               make_row("chat", "no-spec"), make_row("chat", "eagle", 3, alpha=0.45, speedup=0.9, a_k=[0.6, 0.4, 0.3])]
    return Report(TargetInfo("/models/tiny", "abc123"), {"K": [3, 4], "temperatures": [0.0]}, results,
                  [SkippedEntry("gsm8k", "*", "dataset openai/gsm8k not available offline")],
                  recommend(results, target_fingerprint="abc123").to_dict())


def test_report_json_round_trips_with_schema(tmp_path):
    """report.json is valid JSON with the documented top-level keys and loads back to an equal Report."""
    rep = scripted_report()
    files = write_report(rep, tmp_path)
    data = json.loads(files.json.read_text())
    assert list(data) == ["schema_version", "target", "created", "config", "results", "skipped", "recommendations",
                          "parity"]
    assert data["schema_version"] == SCHEMA_VERSION
    assert data["target"] == {"path": "/models/tiny", "fingerprint": "abc123"}
    assert set(data["results"][0]) >= {"domain", "method", "K", "temperature", "alpha", "tau", "a_k", "ms_per_token",
                                       "tokens_per_s", "speedup", "predicted_speedup", "ttft_p50", "ttft_p99",
                                       "itl_p50", "itl_p99", "draft_time_share", "target_time_share",
                                       "repetitions", "spread"}
    assert data["results"][0]["alpha"] is None  # no-spec has no acceptance rate
    assert load_report(files.json) == rep
    assert load_report(tmp_path) == rep  # a directory means its report.json
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_plots_are_written_as_png(tmp_path):
    """All four plots are written, non-empty PNGs, and report.md links them."""
    files = write_report(scripted_report(), tmp_path)
    assert set(files.plots) == {"speedup", "acceptance_curves", "alpha_vs_k", "ms_per_token"}
    for path in files.plots.values():
        blob = path.read_bytes()
        assert blob.startswith(PNG_MAGIC) and len(blob) > 1000
    md = files.markdown.read_text()
    for path in files.plots.values():
        assert f"]({path.name})" in md


def test_plots_without_speculative_rows_skip_what_has_no_data(tmp_path):
    """Baseline-only results still give the ms/token plot; the spec-only plots are left out, not empty."""
    rep = Report(TargetInfo("t", "f"), {}, [make_row("code", "no-spec"), make_row("chat", "no-spec",
                                                                                  ms_per_token_samples=[])])
    files = write_report(rep, tmp_path)
    assert set(files.plots) == {"ms_per_token"}


def test_markdown_has_tables_recommendations_and_skips():
    """report.md: a section per domain with a row per method/K, a_k table, recommendations, skipped reasons."""
    md = render_markdown(scripted_report())
    assert "## code" in md and "## chat" in md
    assert "| eagle | 3 | 0 | 0.750 | 3.25 | 10.00 | 0.50 | 100.0 | 2.00 | 2.20 | 50.0 / 80.0 | 10.0 / 30.0 |" in md
    assert "| no-spec | 0 | 0 | - | - | 20.00 |" in md
    assert "| eagle | 3 | 0 | 0.900 | 0.800 | 0.700 | - |" in md  # a_k padded to the widest K
    assert "## Recommendations" in md and "speed-up 0.900 < 1" in md
    # code's eagle K=3 (alpha 0.75 at 2.0x) stops paying at alpha (1 + 3 * 0.75) / 2.0 - 1) / 3 = 0.208
    assert "| code | 0 | yes | eagle | 3 | 0.750 (0.750) | 2.00 (2.00) | 0.208 |" in md
    assert "| gsm8k | * | dataset openai/gsm8k not available offline |" in md


def _dump(tmp_path, data):
    path = tmp_path / "report.json"
    path.write_text(json.dumps(data))
    return path


def test_schema_version_mismatch_is_a_clear_error(tmp_path):
    """A report of another schema version is refused with both versions named."""
    data = scripted_report().to_dict()
    data["schema_version"] = SCHEMA_VERSION + 1
    expected = rf"schema_version is {SCHEMA_VERSION + 1}.*reads schema_version {SCHEMA_VERSION}"
    with pytest.raises(ReportSchemaError, match=expected):
        load_report(_dump(tmp_path, data))


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["results"][1].update(alpha=1.5), r"results\[1\]\.alpha must be in \[0, 1\]"),
    (lambda d: d["results"][1].pop("tau"), r"results\[1\]: missing field\(s\) tau"),
    (lambda d: d["results"][1].update(K="3"), r"results\[1\]\.K must be an integer"),
    (lambda d: d["results"][1].update(a_k=[0.5, 2.0]), r"results\[1\]\.a_k values"),
    (lambda d: d["results"].append(dict(d["results"][1])), r"repeats \(domain, method, K, temperature\)"),
    (lambda d: d.pop("skipped"), r"field 'skipped' must be a list"),
    (lambda d: d["target"].pop("fingerprint"), r"target\.fingerprint"),
])
def test_invalid_reports_name_the_field(tmp_path, mutate, message):
    """Each malformed field is rejected with its location in the message."""
    data = scripted_report().to_dict()
    mutate(data)
    with pytest.raises(ReportSchemaError, match=message):
        load_report(_dump(tmp_path, data))


def test_failed_write_keeps_the_previous_report(tmp_path, monkeypatch):
    """If the final rename fails, the old report.json is untouched and no temp file is left behind."""
    write_report(scripted_report(), tmp_path, plots=False)
    before = (tmp_path / "report.json").read_text()

    def boom(src, dst):
        raise OSError("disk full")

    from draftsmith.drafts import files
    monkeypatch.setattr(files.os, "replace", boom)
    with pytest.raises(OSError):
        write_report(Report(TargetInfo("other", "zzz"), {}, []), tmp_path, plots=False)
    assert (tmp_path / "report.json").read_text() == before
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


class FakeRun:
    def __init__(self):
        self.logged = []

    def log(self, payload):
        self.logged.append(payload)


def test_wandb_logging_tables_and_images(tmp_path):
    """With a run, results/skipped/recommendations go out as tables and every plot as an image."""
    import wandb

    rep = scripted_report()
    files = write_report(rep, tmp_path)
    run = FakeRun()
    assert log_to_wandb(rep, files.plots, run=run)
    payload = run.logged[0]
    table = payload["eval/results"]
    assert isinstance(table, wandb.Table) and len(table.data) == len(rep.results)
    assert table.columns[:4] == ["domain", "method", "K", "temperature"]
    assert len(payload["eval/skipped"].data) == 1
    assert {r[0] for r in payload["eval/recommendations"].data} == {"(default)", "code", "chat"}
    assert {k for k in payload if k.startswith("eval/plots/")} == {f"eval/plots/{n}" for n in files.plots}


def test_wandb_logging_is_a_noop_without_a_run(monkeypatch):
    """No active run (or WANDB_MODE=disabled) -> nothing is logged and nothing fails."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert log_to_wandb(scripted_report()) is False
    monkeypatch.delenv("WANDB_MODE")
    import wandb
    monkeypatch.setattr(wandb, "run", None)
    assert log_to_wandb(scripted_report()) is False
    assert os.environ.get("WANDB_MODE") is None


def test_nan_metrics_become_null_and_invalid_rows_are_not_written(tmp_path):
    """metrics.py's nan ("no data") in an optional field is written as null (valid JSON); a row that would
    not load back (nan ms/token) is refused before any file is written."""
    rep = Report(TargetInfo("t", "f"), {}, [make_row("code", "eagle", 2, tau=float("nan"), itl_p99=float("inf"))])
    files = write_report(rep, tmp_path / "ok", plots=False)
    row = json.loads(files.json.read_text())["results"][0]
    assert row["tau"] is None and row["itl_p99"] is None
    bad = Report(TargetInfo("t", "f"), {}, [make_row("code", "eagle", 2, ms_per_token=float("nan"))])
    with pytest.raises(ReportSchemaError, match=r"results\[0\]\.ms_per_token"):
        write_report(bad, tmp_path / "bad", plots=False)
    assert not (tmp_path / "bad" / "report.json").exists()


def test_parity_flags_a_served_tau_far_below_the_training_prediction(tmp_path):
    """A draft trained on 2 positions with high accuracy, served at K=4 with tau 1.8: flagged, the cause
    being positions beyond those trained; at K=2 within 0.5 it is not flagged; the section renders."""
    import json as _json

    from draftsmith.serve_eval.eval.parity import parity_rows
    from draftsmith.serve_eval.eval.report_files import render_markdown

    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "draftsmith.json").write_text(_json.dumps({"kind": "eagle3", "metrics": {
        "eval/acc_pos1": 0.9, "eval/acc_pos2": 0.8, "steps": 400}}))
    row = lambda K, tau: ResultRow("code", "eagle3", K, 0.0, 0.6, tau, [0.6] * K, 5.0, 200.0, 1.2, None,  # noqa: E731
                                   None, None, None, None, None, None, 1, 0.0)
    parity = parity_rows([row(4, 1.8), row(2, 2.4)], {"eagle3": str(draft)})
    by_k = {p.K: p for p in parity}
    assert by_k[4].flag.startswith("K=4 is longer than the 2 positions trained")
    assert by_k[2].flag is None and by_k[2].simulated_tau == pytest.approx(1 + 0.9 + 0.72)
    rep = Report(TargetInfo("t", "fp"), {}, [row(4, 1.8)], parity=[p.to_dict() for p in parity])
    assert "## Training vs serving" in render_markdown(rep)
    assert Report.from_dict(rep.to_dict()).parity == rep.parity
