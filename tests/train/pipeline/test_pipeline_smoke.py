"""The main job end to end on the smoke profile, and the pipeline's stage wiring and config checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from draftsmith.train.config import compose
from draftsmith.train.distill.launch import available_cores
from draftsmith.train.pipeline.distill import draft_config, job_config, planned_kinds, union_extras
from draftsmith.train.pipeline.evaluate import render_table, summary_rows

REPO = Path(__file__).resolve().parents[3]
KINDS = ["standalone", "medusa", "eagle", "eagle3"]
VARIANT = "standalone@int8"   # the smoke profile's quantize stage
DOMAINS = ["chat", "code", "math", "prose"]


def run_pipeline(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DRAFTSMITH_NO_PROGRESS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    return subprocess.run([sys.executable, "-m", "draftsmith.train.cli", "pipeline", "pipeline=smoke", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


def stage_lines(proc: subprocess.CompletedProcess) -> dict[str, str]:
    """stage name -> its closing `status=done` log line."""
    lines = {}
    for line in (proc.stdout + proc.stderr).splitlines():
        if "draftsmith stage=" in line and "status=done" in line:
            lines[line.split("stage=")[1].split()[0]] = line
    return lines


def printed_report(proc: subprocess.CompletedProcess) -> str:
    """The report.json path of the pipeline's closing lines."""
    lines = [line for line in proc.stdout.splitlines() if line.startswith("report: ") and line.endswith("report.json")]
    assert lines, proc.stdout[-3000:]
    return lines[-1][len("report: "):]


def test_smoke_pipeline_report_registry_and_cached_rerun(tmp_path):
    """`draftsmith pipeline pipeline=smoke` runs corpus -> ... -> register: report.json holds no-spec, ngram and
    all four drafts in every domain, the summary table and report path are printed, the drafts are promoted in
    the registry with that report; the second run hits every stage's cache and trains nothing."""
    first = run_pipeline(f"artifacts_root={tmp_path}", "wandb.mode=disabled")
    assert first.returncode == 0, first.stderr[-4000:]
    done = stage_lines(first)
    stages = list(compose(["pipeline=smoke"]).pipeline.stages)
    first_distill = stages.index(f"distill_{KINDS[0]}")   # the distill stages train side by side first
    assert list(done) == [*stages[:first_distill], "distill_side_by_side", *stages[first_distill:]]
    for name in ["generate", *[f"distill_{k}" for k in KINDS], "eval"]:
        assert "cached=False" in done[name], done[name]
    if available_cores() >= 2:   # (one core: the stages train one after another)
        assert "trained=4" in done["distill_side_by_side"] and "workers=2" in done["distill_side_by_side"]
        assert all("side_by_side=True" in done[f"distill_{k}"] for k in KINDS)

    # The embedded recipes, tiny: mixed greedy/T=1 answers with top-16, standalone token KD on them, EAGLE-3's
    # vocabulary sized by coverage (logged), each draft's measured cost ratio c (cost stage, printed).
    assert "topk=16" in done["generate"] and "final_hidden=True" in done["generate"]
    log = first.stdout + first.stderr
    assert "kind=eagle3 draft_vocab=" in log and "draft_vocab_coverage=" in done["distill_eagle3"]
    assert "kind=medusa train_temperatures=[0.0] answers=" in log   # Medusa trains on the greedy half
    assert all(f"c_{k}=" in done["cost"] for k in KINDS), done["cost"]
    assert "draft cost ratio c" in first.stdout
    assert all(any(line.strip().startswith(f"{k} ") and " c=" in line for line in first.stdout.splitlines())
               for k in KINDS)

    report_path = Path(printed_report(first))
    report = json.loads(report_path.read_text())
    cells = {(r["domain"], r["method"]) for r in report["results"]}
    for domain in DOMAINS:
        for method in ["no-spec", "ngram", *KINDS, VARIANT]:
            assert (domain, method) in cells, (domain, method, report["skipped"])
    variant_rows = [r for r in report["results"] if r["method"] == VARIANT]
    assert all(r["variant_of"] == "standalone" and r["quantization"] == "int8" for r in variant_rows)
    source_bytes = {(r["domain"], r["temperature"]): r["draft_bytes"] for r in report["results"]
                    if r["method"] == "standalone"}
    assert all(r["draft_bytes"] < source_bytes[(r["domain"], r["temperature"])] for r in variant_rows)
    assert "## Quantized variants" in (report_path.parent / "report.md").read_text()
    assert {r["temperature"] for r in report["results"]} == {0.0, 1.0}
    assert "domain  method" in first.stdout and "speedup" in first.stdout  # the summary table
    assert (report_path.parent / "summary.md").is_file()

    fingerprint = report_path.parts[-4]
    registry = json.loads((tmp_path / "targets" / fingerprint / "registry.json").read_text())
    promoted = {e["kind"]: e for e in registry["entries"] if e["status"] == "promoted"}
    assert sorted(promoted) == sorted(KINDS)
    assert all(e["report_path"] == str(report_path.resolve()) and e["report_method"] == e["kind"]
               for e in promoted.values())

    serve_from_the_pipelines_recommendations(report_path, report)

    again = run_pipeline(f"artifacts_root={tmp_path}", "wandb.mode=disabled")
    assert again.returncode == 0, again.stderr[-4000:]
    redone = stage_lines(again)
    for name in ["corpus", "tokenizer", "target", "generate", *[f"distill_{k}" for k in KINDS], "cost", "eval"]:
        assert "cached=True" in redone[name], redone[name]
    assert "trained=0" in redone["distill_side_by_side"]
    assert f"{VARIANT}=cached" in redone["quantize"], redone["quantize"]
    assert all(f"{k}=cached" in redone["register"] for k in KINDS)
    assert printed_report(again) == str(report_path)
    registry_again = json.loads((tmp_path / "targets" / fingerprint / "registry.json").read_text())
    assert len(registry_again["entries"]) == len(registry["entries"])


def serve_from_the_pipelines_recommendations(report_path: Path, report: dict) -> None:
    """The server runs from the pipeline's own recommendations.yaml: per domain, greedy requests are
    proposed for by the recommended draft (in /metrics), or by none where speculation is off."""
    import httpx

    from draftsmith.serve_eval.eval.recommend import load_recommendations
    from draftsmith.serve_eval.server.run import ServeConfig, build_app
    from draftsmith.serve_eval.server.testing import ServerThread

    routes = report_path.parent / "recommendations.yaml"
    recs = load_recommendations(routes)
    cfg = ServeConfig(num_gpu_blocks=128, recommendations=str(routes), batch_gate="off")
    with ServerThread(build_app(report["target"]["path"], cfg)) as server, \
            httpx.Client(base_url=server.base_url, timeout=120) as client:
        for domain in DOMAINS:
            r = client.post("/v1/completions", json={"prompt": "def main():", "max_tokens": 6, "temperature": 0,
                                                     "ignore_eos": True, "domain": domain})
            assert r.status_code == 200, r.text
        metrics = client.get("/metrics").text
    for domain in DOMAINS:
        choice = recs.choose(domain, 0.0)
        shown = f'spec_decode_num_drafts_by_draft_total{{domain="{domain}",method="{choice.method}"}}'
        assert (shown in metrics) == choice.speculate, (domain, choice)
        assert choice.speculate or f'by_draft_total{{domain="{domain}",' not in metrics


def test_bad_stage_setting_fails_before_any_stage(tmp_path):
    """An unknown key in a later stage's settings stops the job at start, naming the field, before the corpus."""
    proc = run_pipeline(f"artifacts_root={tmp_path}", "wandb.mode=disabled", "+pipeline.train.no_such_knob=1")
    assert proc.returncode != 0
    assert "pipeline.train" in proc.stderr and "no_such_knob" in proc.stderr
    assert "stage=corpus" not in proc.stdout + proc.stderr


def test_kind_configs_compose_from_their_entries():
    """Each distill stage gets conf/draft/<kind>.yaml typed by its schema, the shared data block and the
    profile's overrides; the draft group counts only when it is that kind; trainer = train + pipeline.train."""
    cfg = compose(["pipeline=smoke", "draft=eagle3", "draft.ttt_steps=5", "+pipeline.train_by_kind.eagle.max_steps=9"])
    assert planned_kinds(cfg) == KINDS
    eagle3 = draft_config(cfg, "eagle3")
    assert eagle3.kind == "eagle3" and eagle3.ttt_steps == 2  # profile (pipeline.drafts) over the draft group
    assert draft_config(cfg, "medusa").num_heads == 2 and draft_config(cfg, "medusa").mode == "offline"
    for kind in KINDS:
        assert draft_config(cfg, kind).data.max_prompts == cfg.pipeline.data.max_prompts
    assert job_config(cfg, "eagle").train.max_steps == 9 and job_config(cfg, "medusa").train.max_steps == 6
    with pytest.raises(ValueError, match="pipeline.drafts.medusa"):
        draft_config(compose(["pipeline=smoke", "+pipeline.drafts.medusa.heads=3"]), "medusa")
    with pytest.raises(ValueError, match="not a draft kind"):
        draft_config(cfg, "lookahead")


def test_union_extras_covers_every_kind():
    """The one dataset stores what every kind needs: final hidden if any, every aux layer a kind reads, the largest
    top-k."""
    from draftsmith.train.distill.gendata import StoredExtras

    union = union_extras([StoredExtras(), StoredExtras(final_hidden=True), StoredExtras(True, [2, 4, 5]),
                          StoredExtras(topk=8)])
    assert union == StoredExtras(final_hidden=True, aux_layers=[2, 4, 5], topk=8)
    assert all(union.covers(n) for n in [StoredExtras(True), StoredExtras(True, [2, 4, 5]), StoredExtras(topk=4)])
    # kinds on different layers (EAGLE-3's, the block draft's) share one dataset holding both sets
    both = union_extras([StoredExtras(True, [2, 4, 5]), StoredExtras(True, [2, 4, 6])])
    assert both.aux_layers == [2, 4, 5, 6] and both.covers(StoredExtras(True, [2, 4, 6]))
    assert not both.covers(StoredExtras(True, [2, 3, 6]))


def test_summary_keeps_best_k_per_method_and_temperature():
    """The summary has one row per (domain, method, T), the K with the highest speed-up, no-spec first."""
    from draftsmith.serve_eval.eval.report import ResultRow

    def row(method, K, speedup, alpha=None, T=0.0):
        return ResultRow(domain="code", method=method, K=K, temperature=T, alpha=alpha, tau=None, a_k=[],
                         ms_per_token=10.0 / speedup, tokens_per_s=1.0, speedup=speedup, predicted_speedup=None,
                         ttft_p50=None, ttft_p99=None, itl_p50=None, itl_p99=None, draft_time_share=None,
                         target_time_share=None, repetitions=1, spread=0.0, ms_per_token_samples=[])

    class Report:
        results = [row("eagle", 2, 1.4, 0.7), row("eagle", 4, 1.6, 0.6), row("no-spec", 0, 1.0),
                   row("eagle", 4, 0.9, 0.5, T=1.0)]

    rows = summary_rows(Report)
    assert [(r[1], r[2], r[3]) for r in rows] == [("no-spec", "0", "0"), ("eagle", "0", "4"), ("eagle", "1", "4")]
    assert rows[1][4:] == ["0.600", "-", "6.25", "1.60"]
    table = render_table(["domain", "method", "T", "K", "alpha", "tau", "ms/token", "speedup"], rows)
    assert len({len(line) for line in table.splitlines()}) == 1  # aligned columns
