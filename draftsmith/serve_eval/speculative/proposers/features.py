"""What every proposer that reads the target's features shares (Medusa, EAGLE-1/3, block): loading the
draft with the target checks, its serving form, the features-argument adapter, feature checks and
drawing draft tokens from their rows."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from draftsmith.drafts.io import ExpectedTarget, LoadedDraft, load_draft
from draftsmith.kernels.sampling import sample
from draftsmith.serve_eval.engine.model_executor import resolve_dtype
from draftsmith.serve_eval.speculative.proposers.base import SequenceView, TargetFeatures


def load_feature_draft(spec_config: Any, target_executor: Any, device, dtype, kinds: tuple[str, ...],
                       target_model_dir: str | Path | None = None) -> LoadedDraft:
    """load_draft(spec_config.draft_path) checked against the target and the proposer's kind.

    With target_model_dir the target fingerprint is checked too (a feature draft for another target is an
    error); without it only the vocabulary and hidden sizes of target_executor.config can be compared.
    """
    draft_path = getattr(spec_config, "draft_path", None)
    if not draft_path:
        raise ValueError(f"speculative config: draft_path is required for a {'/'.join(kinds)} proposer")
    if target_model_dir is not None:
        expected = ExpectedTarget.from_model_dir(target_model_dir)
    else:
        expected = ExpectedTarget.from_config(target_executor.config)
    loaded = load_draft(draft_path, expected, device=device, dtype=dtype,
                        strict_fingerprint=getattr(spec_config, "strict_fingerprint", None))
    if loaded.kind not in kinds:
        raise ValueError(f"{draft_path}: draft kind is {loaded.kind!r}, but this proposer needs {' or '.join(kinds)}")
    return loaded


def engine_build_args(spec_config: Any, engine: Any) -> tuple:
    """(spec_config, target_executor, device, dtype, target_model_dir) for a proposer built by the engine."""
    executor = engine.executor
    dtype = resolve_dtype(spec_config.draft_dtype) if getattr(spec_config, "draft_dtype", None) else executor.dtype
    return spec_config, executor, executor.device, dtype, engine.config.model


def feed_features(proposer: Any, seqs: Sequence[SequenceView], features: Sequence[object] | None) -> None:
    """The Proposer protocol's optional `features` argument: per sequence a TargetFeatures or None."""
    if features is None:
        return
    if len(features) != len(seqs):
        raise ValueError(f"got {len(features)} features entries for {len(seqs)} sequences")
    for seq, feats in zip(seqs, features):
        if feats is not None:
            proposer.add_features(seq.request_id, feats)


def check_features(feats: TargetFeatures, expected_start: int | None, request_id: str, width: int, what: str) -> None:
    """ValueError naming both sides when fed rows are not the next consecutive positions or have the wrong width."""
    check_feature_rows(feats.hidden if what == "hidden" else feats.aux, f"request {request_id}: TargetFeatures", width,
                       what)
    check_feature_start(feats.start_pos, expected_start, request_id)


def check_feature_rows(rows: Tensor | None, owner: str, width: int, what: str) -> None:
    """ValueError unless rows is [n, width] (owner and what name the field: 'request r: TargetFeatures', 'hidden')."""
    if rows is None or rows.dim() != 2 or rows.shape[1] != width:
        shape = None if rows is None else tuple(rows.shape)
        raise ValueError(f"{owner}.{what} must be [n, {width}], got {shape}")


def check_feature_start(start_pos: int, expected_start: int | None, request_id: str) -> None:
    """ValueError unless fed rows start at the next consecutive position (None: the request's first rows)."""
    if expected_start is not None and start_pos != expected_start:
        raise ValueError(
            f"request {request_id}: TargetFeatures.start_pos is {start_pos} but the proposer expects the next "
            f"position {expected_start} (features must be consecutive; call reset() to start over)"
        )


def draw_rows(probs: Tensor, generators: Sequence[torch.Generator | None], greedy: Sequence[bool]) -> Tensor:
    """One token per row of probs [N, V]: argmax for greedy rows (no RNG use), else drawn with the row's generator."""
    tokens = probs.argmax(dim=-1)
    sampled = [i for i, g in enumerate(greedy) if not g]
    if sampled:
        idx = torch.tensor(sampled, device=probs.device)
        tokens[idx] = sample(probs[idx], [generators[i] for i in sampled]).to(tokens.device)
    return tokens


def serving_form(draft: torch.nn.Module, copy_first: bool = True) -> torch.nn.Module:
    """The draft in its serving form (kernels.layers: fused q/k/v and gate/up, oneDNN-packed bf16 weights on
    CPU), so a draft step runs the engine's own fast path and costs what its weights weigh.

    copy_first leaves the caller's module untouched (training code and tests may still hold it); a draft
    loaded for this proposer alone is converted in place."""
    return (copy.deepcopy(draft) if copy_first else draft).eval().to_serving_()


# ------------------------------------------------------------------------------------------------ proposer
