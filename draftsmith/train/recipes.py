"""Recipe checks: draft settings that cannot work stop before long work; settings that waste the draft warn.

Errors are one line naming the field and its value (a ValueError the CLI prints as it is). Warnings are
strings: the pipeline logs them at the start and repeats them in the report's summary, so a short TTT
unroll is visible beside the acceptance it costs. Also here: the EAGLE-3 reduced vocabulary sized by
coverage of the training answers (the share of answer tokens the draft can propose at all).
"""

from __future__ import annotations

from typing import Any

import torch

from draftsmith.drafts.schemas import generated_temperatures

VOCAB_MULTIPLE = 64  # a coverage-sized vocabulary is rounded up to this (matmul-friendly widths)


def check_recipe(kind: str, dcfg: Any, target_vocab: int | None) -> None:
    """ValueError for a setting of draft ``kind`` that cannot work (``target_vocab``: None when unknown yet)."""
    from draftsmith.train.distill.dataset.settings import check_data_config, data_config

    check_data_config(data_config(dcfg))
    check_train_temperatures(dcfg)
    topk = int(dcfg.data.topk_logits)
    if kind == "standalone":
        if dcfg.loss == "token_kd" and dcfg.teacher == "topk" and topk <= 0:
            raise ValueError(f"draft.data.topk_logits: {topk} (draft.teacher=topk needs the target's stored top-k "
                             "log-probs: set it >= 1, or draft.teacher=online)")
        if dcfg.hard_weight < 0:
            raise ValueError(f"draft.hard_weight: {dcfg.hard_weight} must be >= 0")
    if kind == "eagle3":
        size, coverage = dcfg.draft_vocab_size, dcfg.get("draft_vocab_coverage")
        if size is not None and (size < 1 or (target_vocab is not None and size > target_vocab)):
            raise ValueError(f"draft.draft_vocab_size: {size} is outside 1..{target_vocab or 'the target vocabulary'} "
                             "(the target's vocabulary)")
        if coverage is not None and not 0.0 < coverage <= 1.0:
            raise ValueError(f"draft.draft_vocab_coverage: {coverage} is outside (0, 1]")
        if dcfg.ttt_steps < 1:
            raise ValueError(f"draft.ttt_steps: {dcfg.ttt_steps} must be >= 1")
    if kind == "block":
        if dcfg.block_size < 2:
            raise ValueError(f"draft.block_size: {dcfg.block_size} must be >= 2 (1 root + at least one mask)")
        if dcfg.max_anchors < 1:
            raise ValueError(f"draft.max_anchors: {dcfg.max_anchors} must be >= 1")
    if kind in ("eagle3", "block") and not dcfg.get("label_temperature", 1.0) > 0:
        raise ValueError(f"draft.label_temperature: {dcfg.label_temperature} must be > 0")


def check_train_temperatures(dcfg: Any) -> None:
    """draft.train_temperatures must name temperatures the dataset generates answers at."""
    wanted = dcfg.get("train_temperatures")
    if wanted is None:
        return
    generated = generated_temperatures(dcfg.data)
    missing = [float(t) for t in wanted if float(t) not in generated]
    if not wanted or missing:
        raise ValueError(f"draft.train_temperatures: {list(wanted)} names {missing or 'no temperature'}, but the "
                         f"dataset's answers are generated at {generated or 'none (data.source=corpus)'} "
                         "(data.temperature where data.sampled_fraction < 1, data.sampled_temperature where it is > 0)")


def check_eval_ks(kind: str, dcfg: Any, eval_ks: list[int]) -> None:
    """The block draft proposes at most block_size - 1 tokens: an eval K above that stops the job now (the
    proposer would refuse it after the draft trained)."""
    if kind == "block" and eval_ks and max(eval_ks) > dcfg.block_size - 1:
        raise ValueError(f"pipeline.drafts.block.block_size: {dcfg.block_size} proposes at most {dcfg.block_size - 1} "
                         f"tokens, but the eval asks for K={max(eval_ks)} (set block_size >= {max(eval_ks) + 1})")


def planned_target_vocab(cfg: Any) -> int | None:
    """The target's vocabulary before it exists: a user's checkpoint's config.json, or the embedded
    target's configured size (its tokenizer is trained to that size)."""
    import json
    from pathlib import Path

    if cfg.target.get("path"):
        config = Path(cfg.target.path).expanduser() / "config.json"
        return int(json.loads(config.read_text())["vocab_size"]) if config.is_file() else None
    return cfg.target.get("vocab_size")


def recipe_warnings(kind: str, dcfg: Any, eval_ks: list[int], eval_temperatures: list[float] = ()) -> list[str]:
    """Settings that work but waste the draft at the K and temperatures the eval asks for."""
    largest = max(eval_ks, default=0)
    out = []
    trained = dcfg.get("train_temperatures")
    unseen = [float(t) for t in eval_temperatures if trained is not None and float(t) not in map(float, trained)]
    if unseen:
        out.append(f"{kind}: draft.train_temperatures={list(trained)} but the eval measures it at T={unseen}: "
                   f"it never trained on answers sampled there (expect alpha to fall; add them, or set "
                   f"eval.temperatures_of.{kind})")
    if kind == "eagle3" and dcfg.ttt_steps < largest:
        out.append(f"eagle3: draft.ttt_steps={dcfg.ttt_steps} is shorter than the largest eval K={largest}: "
                   f"positions past {dcfg.ttt_steps} are drafted from features the draft never trained on "
                   f"(expect a_k to fall there; set ttt_steps >= {largest})")
    return out


def reduced_vocab_size(counts: torch.Tensor, size: int | None, coverage: float | None) -> tuple[int | None, float]:
    """(draft vocabulary size, share of answer tokens it covers). ``size`` wins when given; else the smallest
    count of most frequent tokens covering ``coverage`` (rounded up to VOCAB_MULTIPLE); neither: the full
    vocabulary (None, 1.0)."""
    counts = counts.double().flatten()
    total = float(counts.sum())
    if size is None and coverage is None or total == 0:
        return size, 1.0
    ranked = torch.sort(counts, descending=True, stable=True).values.cumsum(0) / total
    if size is None:
        needed = int(torch.searchsorted(ranked, torch.tensor(coverage, dtype=torch.float64) - 1e-12)) + 1
        size = min(len(counts), -(-needed // VOCAB_MULTIPLE) * VOCAB_MULTIPLE)
    return size, float(ranked[min(size, len(counts)) - 1])
