"""The pipeline's stage results: typed fields, and a stage that reads an output no earlier stage made is
refused naming both stages."""

from __future__ import annotations

from pathlib import Path

import pytest

from draftsmith.drafts.artifacts import Artifacts
from draftsmith.train.config import compose
from draftsmith.train.logs import init_wandb
from draftsmith.train.pipeline.context import MissingStageResult, PipelineContext, StageResults, need
from draftsmith.train.pipeline.run import STAGES, run, run_stages


def smoke_context(tmp_path: Path) -> PipelineContext:
    cfg = compose(["pipeline=smoke", f"artifacts_root={tmp_path}", "wandb.mode=disabled"])
    return PipelineContext(cfg, Artifacts(tmp_path), init_wandb(cfg, job_type="test", wandb_dir=tmp_path / "wandb"))


def test_need_returns_a_produced_result_and_names_the_missing_stage():
    results = StageResults(dataset=Path("/data/x"))
    assert need(results.dataset, "generate") == Path("/data/x")
    with pytest.raises(MissingStageResult, match="pipeline.stages: a stage needs the 'eval' stage before it"):
        need(results.eval_dir, "eval")
    assert results.drafts == {} and results.recipe_warnings == [] and results.cost is None


@pytest.mark.parametrize(("reader", "producer"), [
    ("tokenizer", "corpus"), ("target", "corpus"), ("generate", "target"), ("distill_eagle", "target"),
    ("cost", "target"), ("eval", "target"), ("report", "eval"), ("register", "target"),
])
def test_a_stage_without_its_input_is_refused_naming_both_stages(tmp_path, reader, producer):
    ctx = smoke_context(tmp_path)
    with pytest.raises(ValueError, match=f"pipeline.stages: '{reader}' needs the '{producer}' stage before it"):
        run_stages(ctx, [(reader, STAGES[reader])])


def test_distill_after_the_target_without_generate_names_generate(tmp_path):
    """With the target there, a distill stage's next missing input is the dataset of 'generate'."""
    ctx = smoke_context(tmp_path)
    ctx.results.target = object()  # (never read further: the dataset check comes first)
    with pytest.raises(ValueError, match="'distill_medusa' needs the 'generate' stage before it"):
        run_stages(ctx, [("distill_medusa", STAGES["distill_medusa"])])


def test_pipeline_run_with_stages_out_of_order_fails_in_one_line(tmp_path):
    cfg = compose(["pipeline=smoke", "pipeline.stages=[report]", f"artifacts_root={tmp_path}", "wandb.mode=disabled"])
    with pytest.raises(ValueError, match=r"^pipeline.stages: 'report' needs the 'eval' stage before it$"):
        run(cfg)
