"""The distill trainer's settings (`conf/train/*.yaml`) and its learning-rate schedule."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

LR_SCHEDULES = ("constant", "linear", "cosine")
_VOLATILE = {"volatile": True}  # fields that cannot change the loss trajectory: left out of the config hash


@dataclass
class TrainerConfig:
    """Schema of `conf/train/*.yaml` (the loop; objectives carry their own settings in `draft`)."""

    output_dir: str = field(default="artifacts/distill/run", metadata=_VOLATILE)
    max_steps: int = 100  # optimizer steps
    batch_size: int = 8  # micro-batch per rank
    gradient_accumulation_steps: int = 1
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_steps: int = 0
    lr_schedule: str = "cosine"  # constant | linear | cosine (after warmup)
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0  # max global grad norm; 0 = off
    mixed_precision: str = "no"  # no | bf16 | fp16 | auto (bf16 where it is faster than fp32 here)
    # torch intra-op threads of this process: auto = its share of the cores (cores / local processes). Set at
    # the trainer's start, so a job does not inherit the count an earlier stage's engine chose for decoding.
    num_threads: int | str = field(default="auto", metadata=_VOLATILE)
    seed: int = 0
    shuffle: bool = True
    pad_token_id: int = 0
    max_length: int | None = None
    num_workers: int = 0
    eval_every: int = field(default=0, metadata=_VOLATILE)  # 0: only at the end
    eval_batch_size: int = field(default=8, metadata=_VOLATILE)
    log_every: int = field(default=1, metadata=_VOLATILE)
    checkpoint_every: int = field(default=0, metadata=_VOLATILE)  # 0: only at the end
    keep_last: int = field(default=2, metadata=_VOLATILE)
    resume: str = field(default="auto", metadata=_VOLATILE)  # auto | never | <checkpoint dir>
    # Wall-clock cap (minutes of this fit call): training stops after the step that crosses it, saves, evaluates
    # and logs that the cap cut in. Volatile: a rerun with another cap reuses the export.
    max_minutes: float | None = field(default=None, metadata=_VOLATILE)
    # With max_minutes: the schedule's progress is also elapsed / max_minutes (whichever is further, as the target's
    # training does), so a cap that binds ends an annealed schedule instead of cutting a cosine mid-way, and
    # max_steps can be a generous ceiling on a fast machine. Volatile, as the cap itself.
    anneal_to_time_cap: bool = field(default=False, metadata=_VOLATILE)

    def validate(self) -> None:
        for name in ("max_steps", "batch_size", "gradient_accumulation_steps", "eval_batch_size", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"train.lr_schedule: {self.lr_schedule!r} is not one of {LR_SCHEDULES}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.warmup_steps < 0 or self.grad_clip < 0:
            raise ValueError("train.warmup_steps and train.grad_clip must be >= 0")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise ValueError(f"train.max_minutes must be > 0 (or null: no cap), got {self.max_minutes}")
        if self.num_threads != "auto" and (isinstance(self.num_threads, bool) or not isinstance(self.num_threads, int)
                                           or self.num_threads < 1):
            raise ValueError(f"train.num_threads must be a positive int or 'auto', got {self.num_threads!r}")

    def trajectory_fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if not f.metadata.get("volatile")}


def lr_factor(step: int, warmup_steps: int, max_steps: int, schedule: str, min_lr_ratio: float,
              time_frac: float = 0.0) -> float:
    """Multiplier of the base LR for optimizer step `step` (0-based): linear warmup, then decay over the step budget,
    or over the time budget where `time_frac` (elapsed / cap, 0 without one) is further along."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress_frac = min(1.0, max((step - warmup_steps) / max(1, max_steps - warmup_steps), time_frac))
    decay = 1.0 - progress_frac if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress_frac))
    return min_lr_ratio + (1.0 - min_lr_ratio) * decay
