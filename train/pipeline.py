"""``draftsmith pipeline``: the main job, a list of cached stages run in order.

Today: corpus -> tokenizer -> target. Later issues add stages (distill, eval, report) by name in
``STAGES`` or, without touching this file, as ``"package.module:function"`` in ``pipeline.stages``.
A stage is ``fn(ctx: PipelineContext) -> dict`` : it reads earlier stages' outputs from
``ctx.results``, stores its own output under its name, and returns fields for its log line.

    draftsmith pipeline                      # embedded default
    draftsmith pipeline pipeline=smoke       # tiny, < 3 minutes
    draftsmith pipeline target.path=/ckpt    # any HF Llama-family checkpoint as the target
    python -m train.pipeline ...             # same thing
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig

from train.artifacts import Artifacts, read_json
from train.config import hydra_app
from train.logs import init_wandb, log_event, stage

STAGES: dict[str, str] = {
    "corpus": "train.pipeline:stage_corpus",
    "tokenizer": "train.pipeline:stage_tokenizer",
    "target": "train.pipeline:stage_target",
}


@dataclass
class PipelineContext:
    cfg: DictConfig
    artifacts: Artifacts
    run: Any  # W&B run (or a no-op stand-in)
    results: dict[str, Any] = field(default_factory=dict)  # stage name -> its output

    def forced(self, stage_name: str) -> bool:
        return stage_name in self.cfg.pipeline.force


def stage_corpus(ctx: PipelineContext) -> dict[str, Any]:
    from train.corpus import build_corpus

    corpus, cached = build_corpus(ctx.cfg, ctx.artifacts, force=ctx.forced("corpus"))
    ctx.results["corpus"] = corpus
    counts = {f"{split}_{domain}": n for split in ("distill", "eval") for domain, n in corpus.counts[split].items()}
    return {"cached": cached, "hash": corpus.content_hash, "dir": corpus.dir, **counts}


def stage_tokenizer(ctx: PipelineContext) -> dict[str, Any]:
    if ctx.cfg.target.path:  # a user's checkpoint brings its own tokenizer
        ctx.results["tokenizer"] = None
        return {"skipped": True, "reason": "target.path set"}
    from train.tokenizer import build_tokenizer

    path, cached = build_tokenizer(ctx.cfg, ctx.results["corpus"], ctx.artifacts, force=ctx.forced("tokenizer"))
    ctx.results["tokenizer"] = path
    return {"cached": cached, "dir": path}


def stage_target(ctx: PipelineContext) -> dict[str, Any]:
    from train.target import build_target

    result = build_target(ctx.cfg, ctx.results["corpus"], ctx.results.get("tokenizer"), ctx.artifacts,
                          force=ctx.forced("target"), run=ctx.run)
    ctx.results["target"] = result
    ctx.run.summary.update({f"target/ppl_{d}": p for d, p in result.perplexity.items()})
    return {"cached": result.cached, "fingerprint": result.fingerprint, "dir": result.model_dir,
            **{f"ppl_{d}": round(p, 3) for d, p in result.perplexity.items()}}


def resolve_stage(name: str) -> Callable[[PipelineContext], dict[str, Any]]:
    spec = STAGES.get(name, name)
    if ":" not in spec:
        raise ValueError(f"pipeline.stages: unknown stage {name!r} (known: {', '.join(STAGES)}; or 'module:function')")
    module_name, _, attr = spec.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ModuleNotFoundError, AttributeError) as err:
        raise ValueError(f"pipeline.stages: stage {name!r} -> {spec} is not available ({err})") from None


def print_summary(ctx: PipelineContext) -> None:
    from train.target import TARGET_META_FILE

    target = ctx.results.get("target")
    if target is None:
        return
    s = target.shape
    print(f"\ntarget saved at: {target.model_dir}")
    print(f"target fingerprint: {target.fingerprint} (artifacts: {ctx.artifacts.target_dir(target.fingerprint)})")
    print(f"target shape: {s.get('model_type')} layers={s.get('num_hidden_layers')} hidden={s.get('hidden_size')} "
          f"heads={s.get('num_attention_heads')} kv_heads={s.get('num_key_value_heads')} "
          f"ffn={s.get('intermediate_size')} vocab={s.get('vocab_size')} cached={target.cached}")
    print("held-out perplexity per domain:")
    for domain, ppl in target.perplexity.items():
        print(f"  {domain:<8} {ppl:10.3f}")
    meta_file = target.model_dir / TARGET_META_FILE
    if meta_file.is_file() and read_json(meta_file).get("stopped_by_time_cap"):
        meta = read_json(meta_file)
        print(f"note: training stopped at step {meta['steps']} of {meta['target_config']['max_steps']} by "
              "target.max_minutes (slow or busy CPU); 'pipeline.force=[target]' retrains it")


def run(cfg: DictConfig) -> dict[str, Any]:
    """Run the configured stages; every stage's names are checked before the first one starts."""
    artifacts = Artifacts.from_config(cfg)
    stage_fns = [(name, resolve_stage(name)) for name in cfg.pipeline.stages]
    for name in cfg.pipeline.force:
        if name not in cfg.pipeline.stages:
            raise ValueError(f"pipeline.force: {name!r} is not in pipeline.stages {list(cfg.pipeline.stages)}")
    if cfg.target.path:  # a bad checkpoint dir fails now, not after the corpus is built
        from train.target import validate_target_dir

        validate_target_dir(cfg.target.path)
    log_event(job="pipeline", profile=cfg.pipeline.name, stages=",".join(cfg.pipeline.stages),
              artifacts_root=artifacts.root)
    wandb_run = init_wandb(cfg, job_type="pipeline", wandb_dir=artifacts.wandb_dir)
    ctx = PipelineContext(cfg, artifacts, wandb_run)
    try:
        for name, fn in stage_fns:
            with stage(name) as fields:
                fields.update(fn(ctx))
        print_summary(ctx)
    finally:
        wandb_run.finish()
    return ctx.results


main = hydra_app(run)

if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # torch is not loaded yet; see train.cli
    main()
