"""What the pipeline's stages share: the config, the artifacts root, the W&B run, and each stage's output.

A stage is ``fn(ctx: PipelineContext) -> dict``: it reads earlier stages' outputs from ``ctx.results``
(by stage name), stores its own under its name, and returns the fields of its log line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig

from drafts.artifacts import Artifacts


@dataclass
class PipelineContext:
    cfg: DictConfig
    artifacts: Artifacts
    run: Any  # W&B run (or a no-op stand-in)
    results: dict[str, Any] = field(default_factory=dict)  # stage name -> its output
    wall_s: dict[str, float] = field(default_factory=dict)  # stage name -> its wall time (printed at the end)

    def forced(self, stage_name: str) -> bool:
        return stage_name in self.cfg.pipeline.force
