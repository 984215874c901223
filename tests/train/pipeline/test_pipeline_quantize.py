"""The pipeline's ``quantize`` stage: pipeline.quantize checked in one line per bad field, variants made from
this run's drafts (cached on rerun, redone when forced) and handed to the eval beside their source."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from draftsmith.drafts.artifacts import Artifacts
from draftsmith.drafts.quant import QuantRecord
from draftsmith.train.config import compose
from draftsmith.train.logs import init_wandb
from draftsmith.train.pipeline.context import PipelineContext
from draftsmith.train.pipeline.evaluate import eval_node
from draftsmith.train.pipeline.quantize import planned_variants
from draftsmith.train.pipeline.run import STAGES, run_stages


def context(tmp_path: Path, *overrides: str) -> PipelineContext:
    cfg = compose(["pipeline=smoke", f"artifacts_root={tmp_path}", "wandb.mode=disabled", *overrides])
    return PipelineContext(cfg, Artifacts(tmp_path), init_wandb(cfg, job_type="test", wandb_dir=tmp_path / "wandb"))


@pytest.fixture(scope="module")
def standalone_draft(tmp_path_factory):
    from draftsmith.drafts.io import save_draft
    from draftsmith.drafts.standalone import StandaloneDraft
    from draftsmith.serve_eval.server.testing import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("pipeline-quant")
    target = build_tiny_checkpoint(root / "target", num_layers=2, hidden_size=64)
    cfg = json.loads((target / "config.json").read_text())
    draft = save_draft(StandaloneDraft.from_target_config(cfg, num_layers=1), root / "drafts" / "standalone-ab12",
                       "standalone", "fp")
    return target, draft


def test_the_smoke_and_embedded_profiles_plan_their_variants():
    assert [v.label for v in planned_variants(compose(["pipeline=smoke"]))] == ["standalone@int8"]
    assert [v.label for v in planned_variants(compose(["pipeline=embedded"]))] == ["standalone@int4-g64"]
    assert "quantize" in compose(["pipeline=embedded"]).pipeline.stages


@pytest.mark.parametrize(("entry", "message"), [
    ("{draft: lookahead, bits: 8}", r"pipeline.quantize\[0\].draft: 'lookahead' is not a draft this pipeline "
                                    r"distills; allowed values: \['standalone'"),
    ("{draft: standalone, bits: 3}", r"pipeline.quantize\[0\]: quant.bits: 3 is not supported; allowed values: "
                                     r"\[8, 4\]"),
    ("{draft: standalone, bits: 4, group_size: 48}", r"pipeline.quantize\[0\]: quant.group_size: 48 is not "
                                                     r"supported for int4; allowed values: \[32, 64, 128, 256\]"),
    ("{draft: standalone, bits: 8, head: true}", r"pipeline.quantize\[0\]: unknown field\(s\) \['head'\]; "
                                                 r"allowed fields"),
])
def test_a_bad_variant_setting_is_one_line_naming_the_field(entry, message):
    cfg = compose(["pipeline=smoke", f"pipeline.quantize=[{entry}]"])
    with pytest.raises(ValueError, match=message):
        planned_variants(cfg)


def test_a_bad_variant_setting_fails_at_job_start():
    from draftsmith.train.pipeline.run import check_stage_configs

    cfg = compose(["pipeline=smoke", "pipeline.quantize=[{draft: standalone, bits: 3}]"])
    with pytest.raises(ValueError, match=r"pipeline.quantize\[0\]: quant.bits: 3"):
        check_stage_configs(cfg)


def test_a_variant_listed_twice_is_refused():
    cfg = compose(["pipeline=smoke", "pipeline.quantize=[{draft: standalone, bits: 8}, {draft: standalone, bits: 8}]"])
    with pytest.raises(ValueError, match=r"pipeline.quantize\[1\]: standalone@int8 is listed twice"):
        planned_variants(cfg)


def test_quantize_needs_the_distill_stage_of_its_draft(tmp_path):
    with pytest.raises(ValueError, match="'quantize' needs the 'distill_standalone' stage before it"):
        run_stages(context(tmp_path), [("quantize", STAGES["quantize"])])


def test_the_stage_makes_cached_variants_and_the_eval_runs_them_beside_their_source(tmp_path, standalone_draft):
    target, draft = standalone_draft
    ctx = context(tmp_path, "pipeline.quantize=[{draft: standalone, bits: 4, group_size: 32}]")
    ctx.results.drafts["standalone"] = draft
    fields = STAGES["quantize"](ctx)
    out = ctx.results.variants["standalone@int4-g32"]
    assert fields == {"standalone@int4-g32": "done"} and out == draft.with_name(f"{draft.name}-int4-g32")
    record = QuantRecord.read(out)
    assert (record.config.bits, record.config.group_size, record.source) == (4, 32, str(draft.resolve()))
    assert STAGES["quantize"](ctx) == {"standalone@int4-g32": "cached"}
    forced = context(tmp_path, "pipeline.quantize=[{draft: standalone, bits: 4, group_size: 32}]",
                     "pipeline.force=[quantize]")
    forced.results.drafts["standalone"] = draft
    assert STAGES["quantize"](forced) == {"standalone@int4-g32": "done"}
    # the source retrained in place (pipeline.force=[distill_standalone]): the old copy is not reused
    weights = next(p for p in draft.iterdir() if p.suffix == ".safetensors")
    weights.write_bytes(weights.read_bytes())
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert STAGES["quantize"](ctx) == {"standalone@int4-g32": "done"}
    # another config at the same label (the head too) replaces the copy instead of reusing it
    head = context(tmp_path, "pipeline.quantize=[{draft: standalone, bits: 4, group_size: 32, quantize_head: true}]")
    head.results.drafts["standalone"] = draft
    assert STAGES["quantize"](head) == {"standalone@int4-g32-head": "done"}

    # the eval stage's settings: this run's drafts and their variants, labelled for the side-by-side rows
    ctx = context(tmp_path, "pipeline.quantize=[{draft: standalone, bits: 4, group_size: 32}]",
                  f"+pipeline.eval.prompts={tmp_path / 'eval.jsonl'}")
    ctx.results.drafts["standalone"] = draft
    STAGES["quantize"](ctx)
    ctx.results.target = SimpleNamespace(model_dir=target, fingerprint="fp")
    assert dict(eval_node(ctx).drafts) == {"standalone": str(draft), "standalone@int4-g32": str(out)}
