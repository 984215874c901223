"""One objective per draft kind, all behind train.distill.objective.Objective."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn


def make_objective(kind: str, dcfg: Any, teacher: Any, target_dir: Path, draft: nn.Module) -> Any:
    """The objective for `kind`; `teacher` is the target in the loop (None in offline-only setups)."""
    if kind == "standalone":
        from train.distill.objectives.standalone import StandaloneObjective

        return StandaloneObjective(dcfg, teacher)
    if kind == "medusa":
        from train.distill.objectives.medusa import MedusaObjective

        return MedusaObjective(dcfg, teacher)
    if kind == "eagle":
        from train.distill.objectives.eagle import EagleObjective

        return EagleObjective(dcfg, teacher)
    if kind == "eagle3":
        from kernels.layers.checkpoint import load_target_embed_and_head
        from train.distill.objectives.eagle3 import Eagle3Objective

        _, lm_head = load_target_embed_and_head(target_dir)
        return Eagle3Objective(dcfg, teacher, lm_head, list(draft.config.aux_layers))
    if kind == "block":
        from train.distill.objectives.block import BlockObjective

        return BlockObjective(dcfg, teacher, list(draft.config.aux_layers), draft.config.block_size)
    raise ValueError(f"draft.kind: {kind!r} is not one of ('standalone', 'medusa', 'eagle', 'eagle3', 'block')")
