"""Reductions every rank takes part in, and the NaN guard that stops them together.

A collective that one rank skips hangs the others, so each function here is called on every rank with the same
arguments' shapes; on one process they are the identity.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import Tensor


class NonFiniteLossError(RuntimeError):
    """A NaN/inf loss or gradient: training stopped before the update; checkpoints are untouched."""

    def __init__(self, step: int, epoch: int, batch_index: int, bad: list[str], last_checkpoint: Path | None):
        self.step, self.epoch, self.batch_index, self.bad = step, epoch, batch_index, bad
        where = ", ".join(bad) if bad else "on another rank"
        super().__init__(
            f"non-finite value at step {step} (epoch {epoch}, batch {batch_index}): {where}. Stopped before the "
            f"optimizer update; last good checkpoint: {last_checkpoint or 'none yet'} (left intact)"
        )


def non_finite_names(accelerator: Accelerator, values: Mapping[str, Tensor | float | None]) -> list[str] | None:
    """The names of this rank's non-finite values, or None when no rank has one (every rank gets the same
    verdict, so all stop at the same step). DeepSpeed's clip_grad_norm_ returns a float, the others a tensor;
    None = not computed."""
    bad = [name for name, v in values.items() if v is not None and not bool(torch.isfinite(torch.as_tensor(v)).all())]
    flag = torch.tensor([float(len(bad))], device=accelerator.device)
    if accelerator.num_processes > 1:
        flag = accelerator.reduce(flag, reduction="sum")
    return bad if flag.item() > 0 else None


def mean_over_ranks(accelerator: Accelerator, values: dict[str, float]) -> dict[str, float]:
    if accelerator.num_processes == 1 or not values:
        return values
    names = sorted(values)
    stacked = torch.tensor([values[n] for n in names], dtype=torch.float64, device=accelerator.device)
    stacked = accelerator.reduce(stacked, reduction="mean")
    return dict(zip(names, stacked.tolist()))


def sum_over_ranks(accelerator: Accelerator, tensor: Tensor) -> Tensor:
    return accelerator.reduce(tensor, reduction="sum") if accelerator.num_processes > 1 else tensor
