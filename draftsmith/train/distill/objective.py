"""The seam between the generic trainer and each draft kind (standalone KD, Medusa, EAGLE-1/3).

An objective owns everything kind-specific: which module is trained, what frozen parts (the target)
it keeps beside it, how a batch becomes a loss, and how draft accuracy per position is counted.
The trainer owns everything else (devices, distribution, accumulation, schedule, checkpoints, logs).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
from torch import Tensor, nn


class PositionCounts(NamedTuple):
    """Held-out draft accuracy as counts, so batches and ranks add up exactly.

    correct[k]: positions where draft step k+1's top-1 equals the target's token (teacher-forced).
    total[k]:   positions where draft step k+1 made a prediction.
    """

    correct: Tensor  # float64 [K]
    total: Tensor  # float64 [K]

    def __add__(self, other: "PositionCounts") -> "PositionCounts":  # type: ignore[override]
        return PositionCounts(self.correct + other.correct, self.total + other.total)

    def accuracies(self) -> list[float]:
        return [(c / t).item() if t > 0 else 0.0 for c, t in zip(self.correct, self.total)]


@runtime_checkable
class Objective(Protocol):
    """What a draft kind plugs into `draftsmith.train.distill.trainer.Trainer`."""

    def build(self, models: Mapping[str, Any], device: torch.device) -> nn.Module:
        """Return the trainable module (what the optimizer steps and accelerate wraps).

        `models` is what the job loaded (e.g. {"target": ..., "draft": ...}). Frozen parts stay on the
        objective, moved to `device`; they are not wrapped by DDP/FSDP and never saved by the trainer.
        """
        ...

    def loss(self, model: nn.Module, batch: Mapping[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """Scalar loss to minimise, and its named components (detached or not) for logging.

        `model` is the module from `build`, possibly wrapped (DDP/FSDP/DeepSpeed): call it, not the
        unwrapped one, so gradient synchronisation hooks run. `model.training` tells training from
        held-out evaluation (the trainer also calls `loss` on held-out batches, under no_grad).
        """
        ...

    def eval_metrics(self, model: nn.Module, batch: Mapping[str, Tensor]) -> PositionCounts:
        """Per-position top-1 agreement of the draft with the target on one held-out batch (no grad)."""
        ...
