"""The pipeline's first stages: the embedded corpus, its tokenizer, and the target (each cached)."""

from __future__ import annotations

from typing import Any

from draftsmith.train.pipeline.context import PipelineContext, need


def stage_corpus(ctx: PipelineContext) -> dict[str, Any]:
    from draftsmith.train.corpus import build_corpus

    corpus, cached = build_corpus(ctx.cfg, ctx.artifacts, force=ctx.forced("corpus"))
    ctx.results.corpus = corpus
    counts = {f"{split}_{domain}": n for split in ("distill", "eval") for domain, n in corpus.counts[split].items()}
    return {"cached": cached, "hash": corpus.content_hash, "dir": corpus.dir, **counts}


def stage_tokenizer(ctx: PipelineContext) -> dict[str, Any]:
    if ctx.cfg.target.path:  # a user's checkpoint brings its own tokenizer
        ctx.results.tokenizer = None
        return {"skipped": True, "reason": "target.path set"}
    from draftsmith.train.tokenizer import build_tokenizer

    path, cached = build_tokenizer(ctx.cfg, need(ctx.results.corpus, "corpus"), ctx.artifacts, force=ctx.forced("tokenizer"))
    ctx.results.tokenizer = path
    return {"cached": cached, "dir": path}


def stage_target(ctx: PipelineContext) -> dict[str, Any]:
    from draftsmith.train.target import build_target

    result = build_target(ctx.cfg, need(ctx.results.corpus, "corpus"), ctx.results.tokenizer, ctx.artifacts,
                          force=ctx.forced("target"), run=ctx.run)
    ctx.results.target = result
    ctx.run.summary.update({f"target/ppl_{d}": p for d, p in result.perplexity.items()})
    return {"cached": result.cached, "fingerprint": result.fingerprint, "dir": result.model_dir,
            **{f"ppl_{d}": round(p, 3) for d, p in result.perplexity.items()}}
