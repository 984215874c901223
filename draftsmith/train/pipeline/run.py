"""``draftsmith pipeline``: the main job, a list of cached stages run in order.

    corpus -> tokenizer -> target -> generate -> distill_standalone / _medusa / _eagle / _eagle3
           -> cost -> eval -> report -> register

Every stage is cached by its inputs' hash (corpus: data config; tokenizer: corpus; target: its config +
corpus; generate: target fingerprint + prompts + sampling + stored extras; distill_<kind>: target + data
manifest + draft and trainer config; eval: target + prompts + eval settings + draft dirs), so a rerun
skips what is done; ``pipeline.force=[name, ...]`` redoes named stages. The job ends with the target's
summary, then one table: domain x method alpha, tau, ms/token, speed-up, and the report path.

A stage is ``fn(ctx: PipelineContext) -> dict``: it reads earlier stages' outputs from ``ctx.results``
(``draftsmith.train.pipeline.context.StageResults``), sets its own field there, and returns fields for its log line.
``STAGES`` holds the built-in ones in their usual order (one ``distill_<kind>`` per registered draft kind);
a new stage is one entry there plus its field in StageResults. ``pipeline.stages`` may also name
``"package.module:function"`` directly.

    draftsmith pipeline                      # embedded default (conf/pipeline/embedded.yaml)
    draftsmith pipeline pipeline=smoke       # tiny, < 3 minutes
    draftsmith pipeline target.path=/ckpt    # any HF Llama-family checkpoint as the target
    draftsmith pipeline pipeline.train.max_steps=50 'pipeline.eval.temperatures=[0.0]'
    python -m draftsmith.train.pipeline ...             # same thing
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig

from draftsmith.drafts.files import read_json
from draftsmith.drafts.kinds import KIND_NAMES
from draftsmith.train.artifacts import artifacts_from_config
from draftsmith.train.config import hydra_app
from draftsmith.train.logs import init_wandb, log_event, stage, warn_event
from draftsmith.train.named import resolve
from draftsmith.train.pipeline.build import stage_corpus, stage_target, stage_tokenizer
from draftsmith.train.pipeline.context import MissingStageResult, PipelineContext, StageResults
from draftsmith.train.pipeline.cost import stage_cost
from draftsmith.train.pipeline.quantize import stage_quantize
from draftsmith.train.pipeline.distill import STAGE_PREFIX, distill, stage_generate
from draftsmith.train.pipeline.side_by_side import plan_stages
from draftsmith.train.pipeline.evaluate import stage_eval, stage_register, stage_report

Stage = Callable[[PipelineContext], dict[str, Any]]
STAGES: dict[str, Stage] = {
    "corpus": stage_corpus,
    "tokenizer": stage_tokenizer,
    "target": stage_target,
    "generate": stage_generate,
    **{f"{STAGE_PREFIX}{kind}": functools.partial(distill, kind=kind) for kind in KIND_NAMES},
    "quantize": stage_quantize,
    "cost": stage_cost,
    "eval": stage_eval,
    "report": stage_report,
    "register": stage_register,
}


def resolve_stage(name: str) -> Stage:
    if name in STAGES:
        return STAGES[name]
    if ":" not in name:
        raise ValueError(f"pipeline.stages: unknown stage {name!r} (known: {', '.join(STAGES)}; or 'module:function')")
    return resolve(name, "pipeline.stages")


def print_target(ctx: PipelineContext) -> None:
    from draftsmith.train.target import TARGET_META_FILE

    target = ctx.results.target
    if target is None:
        return
    s = target.shape
    print(f"\ntarget saved at: {target.model_dir}")
    print(f"target fingerprint: {target.fingerprint} (artifacts: {ctx.artifacts.target_dir(target.fingerprint)})")
    print(f"target shape: {s.get('model_type')} layers={s.get('num_hidden_layers')} hidden={s.get('hidden_size')} "
          f"heads={s.get('num_attention_heads')} kv_heads={s.get('num_key_value_heads')} "
          f"ffn={s.get('intermediate_size')} vocab={s.get('vocab_size')} cached={target.cached}")
    for line in ctx.results.cost.lines if ctx.results.cost else []:
        print(line)
    print("held-out perplexity per domain:")
    for domain, ppl in target.perplexity.items():
        print(f"  {domain:<8} {ppl:10.3f}")
    meta_file = target.model_dir / TARGET_META_FILE
    if meta_file.is_file() and read_json(meta_file).get("stopped_by_time_cap"):
        meta = read_json(meta_file)
        print(f"note: training stopped at step {meta['steps']} of {meta['target_config']['max_steps']} by "
              "target.max_minutes (slow or busy CPU); 'pipeline.force=[target]' retrains it")


def print_summary(ctx: PipelineContext) -> None:
    """Printed last: the target, the eval summary table and report path, each stage's wall time."""
    from draftsmith.train.pipeline.evaluate import print_report

    print_target(ctx)
    print_report(ctx)
    print("stage wall times (s): " + "  ".join(f"{name}={wall:.1f}" for name, wall in ctx.wall_s.items())
          + f"  total={sum(ctx.wall_s.values()):.1f}")


def check_stage_configs(cfg: DictConfig) -> list[str]:
    """The later stages' settings (pipeline.data/drafts/train/eval) fail now, not after the target trains;
    returns the recipe warnings (settings that work but waste a draft), logged here and kept for the report."""
    from draftsmith.train.pipeline.distill import draft_config, planned_kinds, trainer_node
    from draftsmith.train.recipes import (
        check_eval_ks,
        check_recipe,
        planned_target_vocab,
        recipe_warnings,
    )

    if cfg.pipeline.distill_workers < 1:
        raise ValueError(f"pipeline.distill_workers must be >= 1, got {cfg.pipeline.distill_workers}")
    eval_settings = None
    if "eval" in cfg.pipeline.stages:
        from draftsmith.train.pipeline.evaluate import check_eval_settings

        eval_settings = check_eval_settings(cfg)
    if "quantize" in cfg.pipeline.stages:  # a bad variant setting fails before the target trains, not after
        from draftsmith.train.pipeline.quantize import planned_variants

        planned_variants(cfg)
    vocab, warnings = planned_target_vocab(cfg), []
    for kind in planned_kinds(cfg):
        dcfg = draft_config(cfg, kind)
        trainer_node(cfg, kind)
        check_recipe(kind, dcfg, vocab)
        eval_ks = eval_settings.ks_of(kind) if eval_settings is not None else []
        check_eval_ks(kind, dcfg, eval_ks)
        warnings += recipe_warnings(kind, dcfg, eval_ks,
                                    eval_settings.temperatures_for(kind) if eval_settings is not None else [])
    for line in warnings:
        warn_event(check="recipe", warning=line)
    return warnings


def run_stages(ctx: PipelineContext, stage_fns: list[tuple[str, Stage]]) -> None:
    """Each stage in order, timed and logged; a stage reading an output no earlier stage made is named. With
    pipeline.distill_workers > 1 each run of consecutive distill stages is preceded by a side-by-side stage that
    trains them at once (train.pipeline.side_by_side)."""
    for name, fn in plan_stages(stage_fns, ctx.cfg.pipeline.distill_workers):
        with stage(name) as fields:
            try:
                fields.update(fn(ctx))
            except MissingStageResult as err:
                raise err.read_by(name) from None
        ctx.wall_s[name] = ctx.wall_s.get(name, 0.0) + fields["wall_s"]   # a stage may run more than once


def run(cfg: DictConfig) -> StageResults:
    """Run the configured stages; every stage's names are checked before the first one starts."""
    artifacts = artifacts_from_config(cfg)
    stage_fns = [(name, resolve_stage(name)) for name in cfg.pipeline.stages]
    for name in cfg.pipeline.force:
        if name not in cfg.pipeline.stages:
            raise ValueError(f"pipeline.force: {name!r} is not in pipeline.stages {list(cfg.pipeline.stages)}")
    if cfg.target.path:  # a bad checkpoint dir fails now, not after the corpus is built
        from draftsmith.train.target import validate_target_dir

        validate_target_dir(cfg.target.path)
    warnings = check_stage_configs(cfg)
    log_event(job="pipeline", profile=cfg.pipeline.name, stages=",".join(cfg.pipeline.stages),
              artifacts_root=artifacts.root)
    wandb_run = init_wandb(cfg, job_type="pipeline", wandb_dir=artifacts.wandb_dir)
    ctx = PipelineContext(cfg, artifacts, wandb_run, StageResults(recipe_warnings=warnings))
    try:
        run_stages(ctx, stage_fns)
        print_summary(ctx)
    finally:
        wandb_run.finish()
    return ctx.results


main = hydra_app(run)
