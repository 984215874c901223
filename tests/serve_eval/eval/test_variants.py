"""Quantized variants in the eval: their own method rows beside the draft they were quantized from (bf16 both),
the side-by-side table, the recommendation's choice between them on scripted reports, and the routed server
running the variant a recommendations file names."""
from __future__ import annotations

import json

import pytest

from draftsmith.drafts.io import save_draft
from draftsmith.drafts.quant import QuantConfig
from draftsmith.drafts.quantize_job import quantize_dir
from draftsmith.drafts.standalone import StandaloneDraft
from draftsmith.serve_eval.eval.harness import MethodPlan, run_eval, write_outputs
from draftsmith.serve_eval.eval.recommend import (DomainChoice, DraftRoute, Recommendations, Thresholds, load_recommendations,
                                       recommend, write_recommendations)
from draftsmith.serve_eval.eval.report import ResultRow, load_report
from draftsmith.serve_eval.eval.runners import RequestRecord, RunResult, RunSpec
from draftsmith.serve_eval.eval.sources import DraftSource, discover_drafts
from draftsmith.serve_eval.eval.variants import (
    VARIANT_DRAFT_DTYPE,
    mark_variants,
    variant_comparisons,
    variant_draft_dtype,
)
from draftsmith.serve_eval.schemas import EngineSettings, EvalConfig
from draftsmith.serve_eval.speculative.metrics import SpecStats

INT4 = QuantConfig(4, 32)
VARIANT = f"standalone@{INT4.label}"


@pytest.fixture(scope="module")
def standalone_pair(tmp_path_factory):
    """A tiny target, a standalone draft of it and that draft's INT4 copy (drafts.quantize_job)."""
    from draftsmith.drafts.identity import target_fingerprint
    from draftsmith.serve_eval.server.testing import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("variants")
    target = build_tiny_checkpoint(root / "target", num_layers=2, hidden_size=64)
    cfg = json.loads((target / "config.json").read_text())
    base = save_draft(StandaloneDraft.from_target_config(cfg, num_layers=1), root / "standalone", "standalone",
                      target_fingerprint(target))
    quantized, _ = quantize_dir(base, INT4)
    return target, base, quantized


class DraftRunner:
    """ms/token, acceptance and draft seconds per call fixed by the method (two requests, two rounds each)."""

    def __init__(self, method: str, K: int, ms: float, draft_s: float):
        self.method, self.K, self.ms, self.draft_s = method, K, ms, draft_s

    def run(self, prompts, spec: RunSpec, domain):
        records = []
        for _ in prompts:
            stats = SpecStats()
            for _ in range(2):
                stats.record_round(self.K, self.K)
            records.append(RequestRecord(5, 0.1, [10 + i * self.ms / 1000 for i in range(5)],
                                         stats if self.K else None))
        return RunResult(records, 1.0, self.draft_s if self.K else 0.0, 0.01, 0.02)

    def close(self):
        pass


def test_a_variant_is_its_own_row_beside_its_source_and_the_recommendation_names_it(standalone_pair, tmp_path):
    """The variant runs its draft at the int kernels' dtype here, its source as it serves (the engine's dtype);
    the variant row carries its quantization, its source, a
    smaller memory, its draft ms per round and c; report.md shows them side by side; being faster, the
    variant is recommended with the proposer kind, dir and dtype the server needs."""
    target, base, quantized = standalone_pair
    plans: list[MethodPlan] = []
    speed = {"no-spec": (10.0, 0.0), "standalone": (6.0, 0.008), VARIANT: (4.0, 0.004)}   # ms/token, draft s

    def factory(plan: MethodPlan):
        plans.append(plan)
        return DraftRunner(plan.method, plan.K, *speed[plan.method])

    cfg = EvalConfig(methods=["no-spec", "drafts"], num_speculative_tokens=[2], temperatures=[0.0], repetitions=1,
                     warmup=0, max_tokens=8)
    sources = [DraftSource("standalone", base, "standalone"), DraftSource(VARIANT, quantized, "standalone")]
    report = run_eval(cfg, target, "fp", {"chat": ["a", "b"]}, sources, factory=factory)
    by_method = {p.method: p for p in plans}
    here = variant_draft_dtype("cpu")  # the int kernels' bf16 where bf16 is fast, else fp32
    assert by_method[VARIANT].draft.draft_dtype == here and by_method["standalone"].draft.draft_dtype is None
    rows = {r.method: r for r in report.results}
    source, variant = rows["standalone"], rows[VARIANT]
    assert (variant.quantization, variant.variant_of) == (INT4.label, "standalone")
    assert source.quantization is None and source.variant_of is None
    assert 0 < variant.draft_bytes < source.draft_bytes
    # 8 ms of draft time over 4 rounds; c = 2 ms / (K=2 x 10 ms no-spec)
    assert source.draft_ms_per_round == pytest.approx(2.0) and source.cost_ratio == pytest.approx(0.1)
    assert variant.draft_ms_per_round == pytest.approx(1.0) and variant.cost_ratio == pytest.approx(0.05)
    [comparison] = variant_comparisons(report.results)
    assert comparison.draft_step_speedup == pytest.approx(2.0) and comparison.alpha_cost == pytest.approx(0.0)

    files = write_outputs(report, tmp_path / "out", plots=True)
    assert files.plots["variants"].stat().st_size > 0
    loaded = load_report(tmp_path / "out")
    assert {r.method: (r.quantization, r.draft_bytes) for r in loaded.results}[VARIANT] == (INT4.label,
                                                                                             variant.draft_bytes)
    markdown = (tmp_path / "out" / "report.md").read_text()
    section = markdown.split("## Quantized variants")[1].split("## ")[0]
    assert f"| {VARIANT} |" in section and "| standalone |" in section and "2.00" in section
    choice = load_recommendations(tmp_path / "out" / "recommendations.yaml").choose("chat", 0.0)
    assert (choice.method, choice.kind, choice.draft_dtype) == (VARIANT, "standalone", here)
    assert choice.draft_path == str(quantized)


def test_a_variant_whose_source_is_not_in_the_run_is_measured_without_a_comparison(standalone_pair):
    target, _, quantized = standalone_pair
    cfg = EvalConfig(methods=["no-spec", "drafts"], num_speculative_tokens=[2], temperatures=[0.0], repetitions=1,
                     warmup=0)
    report = run_eval(cfg, target, "fp", {"chat": ["a", "b"]}, [DraftSource(VARIANT, quantized, "standalone")],
                      factory=lambda plan: DraftRunner(plan.method, plan.K, 5.0, 0.002))
    row = next(r for r in report.results if r.method == VARIANT)
    assert row.quantization == INT4.label and row.variant_of is None and not variant_comparisons(report.results)
    assert any("source" in note and "not in this run" in note for note in report.config["notes"])


def test_discovered_quantized_dirs_are_labelled_kind_at_quantization(standalone_pair, tmp_path):
    from draftsmith.drafts.artifacts import Artifacts

    _, base, _ = standalone_pair
    home = Artifacts(tmp_path).target_home("fp") / "drafts"
    copy = save_draft(StandaloneDraft.from_target_config(json.loads((base / "config.json").read_text()),
                                                         num_layers=1), home / "standalone-ab", "standalone", "fp")
    quantize_dir(copy, INT4)
    assert sorted(discover_drafts(tmp_path, "fp")) == ["standalone", VARIANT]


def _row(method, speedup, ci, variant_of=None, alpha=0.7):
    return ResultRow(domain="chat", method=method, K=4, temperature=0.0, alpha=alpha, tau=None, a_k=[],
                     ms_per_token=10.0 / speedup, tokens_per_s=1.0, speedup=speedup, predicted_speedup=None,
                     ttft_p50=None, ttft_p99=None, itl_p50=None, itl_p99=None, draft_time_share=None,
                     target_time_share=None, repetitions=3, spread=0.0, alpha_ci=None if alpha is None else [alpha - 0.05, alpha + 0.05],
                     speedup_ci=ci, variant_of=variant_of, quantization=None if variant_of is None else "int4-g64")


ROUTES = {"standalone": DraftRoute("/d/standalone", "standalone", VARIANT_DRAFT_DTYPE),
          VARIANT: DraftRoute("/d/standalone-int4-g64", "standalone", VARIANT_DRAFT_DTYPE)}


@pytest.mark.parametrize("variant_ci, chosen", [
    ([1.45, 1.8], VARIANT),        # faster within its interval: the variant
    ([1.1, 2.0], "standalone"),    # a higher point figure with a wider interval does not win
])
def test_the_recommendation_takes_the_variant_only_when_its_lower_bound_is_faster(variant_ci, chosen):
    rows = [_row("no-spec", 1.0, None, alpha=None), _row("standalone", 1.5, [1.4, 1.6]),
            _row(VARIANT, 1.6, variant_ci, variant_of="standalone", alpha=0.68)]
    [choice] = recommend(rows, Thresholds(), drafts=ROUTES).domains["chat"]
    assert choice.speculate and choice.method == chosen
    assert (choice.draft_path, choice.kind, choice.draft_dtype) == (ROUTES[chosen].path, "standalone", "bfloat16")


def test_a_variant_below_an_alpha_floor_is_not_recommended():
    rows = [_row("no-spec", 1.0, None, alpha=None), _row("standalone", 1.3, [1.2, 1.4]),
            _row(VARIANT, 1.5, [1.4, 1.6], variant_of="standalone", alpha=0.52)]   # alpha low 0.47 < 0.5
    [choice] = recommend(rows, Thresholds(min_alpha=0.5), drafts=ROUTES).domains["chat"]
    assert choice.method == "standalone"


def test_the_routed_server_runs_a_recommended_quantized_variant_exactly(standalone_pair, tmp_path):
    """A recommendations file naming the INT4 variant: the routed proposer loads the quantized dir with the
    standalone proposer at bf16 (int kernels, quantized weight bytes), and greedy output equals no-spec's."""
    from draftsmith.serve_eval.engine import EngineConfig, LLMEngine, SamplingParams
    from draftsmith.serve_eval.speculative.config import SpecConfig
    from spec_helpers import run_engine

    target, base, quantized = standalone_pair
    on = DomainChoice(True, VARIANT, 3, 0.0, str(quantized), kind="standalone", draft_dtype=VARIANT_DRAFT_DTYPE)
    recs = Recommendations(Thresholds(), [on], {"chat": [on]}, "fp")
    path = write_recommendations(recs, tmp_path / "recommendations.yaml")
    prompts = [[5, 9, 13, 2, 7], [3, 3, 8, 1], [11, 4, 6, 10, 12, 2]]
    params = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True) for _ in prompts]
    plain = run_engine(LLMEngine(EngineConfig(str(target), num_gpu_blocks=64)), prompts, params)
    engine = LLMEngine(EngineConfig(str(target), num_gpu_blocks=64),
                       speculative=SpecConfig("routed", routes=str(path)))
    got = run_engine(engine, prompts, params, ["chat"] * len(prompts))
    assert {r: o.output_token_ids for r, o in got.items()} == {r: o.output_token_ids for r, o in plain.items()}
    child = engine.strategy.proposer.children[VARIANT]
    assert engine.strategy.proposer.rounds_by_draft().get(("chat", VARIANT), 0) > 0
    dense = LLMEngine(EngineConfig(str(target), num_gpu_blocks=64), speculative=SpecConfig(
        "standalone", draft_path=str(base), num_speculative_tokens=3, draft_dtype=VARIANT_DRAFT_DTYPE))
    assert child.executor.weight_bytes() < dense.strategy.proposer.executor.weight_bytes()


def test_a_real_engine_eval_measures_the_variant_beside_its_source(standalone_pair, tmp_path):
    """Our engine end to end: the variant's row has alpha, draft ms per round and c like its source's."""
    target, base, quantized = standalone_pair
    prompts_file = tmp_path / "eval.jsonl"
    prompts_file.write_text("\n".join(json.dumps({"domain": "chat", "prompt": f"hello {w} the cat"})
                                      for w in ("one", "two")) + "\n")
    from draftsmith.serve_eval.eval.sources import group_prompts, load_prompt_records

    prompts, _ = group_prompts(load_prompt_records(prompts_file), [], lambda _: 2, "eval.jsonl")
    cfg = EvalConfig(methods=["no-spec", "drafts"], num_speculative_tokens=[2], temperatures=[0.0], repetitions=1,
                     warmup=0, max_tokens=10, ignore_eos=True, strict_fingerprint=False,
                     engine=EngineSettings(kv_cache_memory_gb=0.02))
    report = run_eval(cfg, target, "fp", prompts, [DraftSource("standalone", base, "standalone"),
                                                   DraftSource(VARIANT, quantized, "standalone")])
    rows = {r.method: r for r in report.results}
    assert set(rows) == {"no-spec", "standalone", VARIANT}, report.skipped
    for row in (rows["standalone"], rows[VARIANT]):
        assert 0 <= row.alpha <= 1 and row.draft_ms_per_round > 0 and row.cost_ratio > 0
    assert rows[VARIANT].draft_bytes < rows["standalone"].draft_bytes


@pytest.mark.parametrize("fast", [True, False])
def test_a_variant_runs_bf16_only_where_bf16_is_fast_and_its_source_as_it_serves(standalone_pair, monkeypatch,
                                                                                   fast):
    """Where bf16 is emulated (an AVX2-only CPU: ~9x a fp32 matmul) the variant runs fp32 and dequantizes; its
    source keeps the engine's dtype either way (its row is the one the recommendations judge, on the engine's
    fp32 C paths)."""
    from draftsmith.kernels import precision

    monkeypatch.setattr(precision, "bf16_is_fast", lambda device="cpu": fast)
    _, base, quantized = standalone_pair
    sources = [DraftSource("standalone", base, "standalone"), DraftSource(VARIANT, quantized, "standalone")]
    notes = mark_variants(sources, "cpu")
    expected = "bfloat16" if fast else "float32"
    assert [s.draft_dtype for s in sources] == [None, expected]
    assert any(expected in note for note in notes)
