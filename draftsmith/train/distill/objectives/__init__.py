"""One objective per draft kind, all behind train.distill.objective.Objective (registered by kind)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from draftsmith.train.distill.objectives.registry import objective_builder


def make_objective(kind: str, dcfg: Any, teacher: Any, target_dir: Path, draft: nn.Module) -> Any:
    """The objective for `kind`; `teacher` is the target in the loop (None in offline-only setups)."""
    return objective_builder(kind)(dcfg, teacher, target_dir, draft)
