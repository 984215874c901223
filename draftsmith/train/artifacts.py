"""The artifacts root as a Hydra job sees it: `draftsmith.drafts.artifacts.Artifacts` at `cfg.artifacts_root`.

The layout itself, atomic writes and hashing live in `draftsmith.drafts.artifacts` and `draftsmith.drafts.files`, where
every room can read them; this module only resolves a relative root against the directory the user
launched the job from (Hydra changes the working directory).
"""

from __future__ import annotations

from pathlib import Path

from hydra.utils import get_original_cwd
from omegaconf import DictConfig

from draftsmith.drafts.artifacts import Artifacts


def resolve_root(artifacts_root: str) -> Path:
    """Absolute artifacts root; a relative one is taken from where the user launched the job."""
    root = Path(artifacts_root).expanduser()
    if not root.is_absolute():
        try:
            base = Path(get_original_cwd())  # inside a Hydra app, even if it changed directory
        except ValueError:
            base = Path.cwd()
        root = base / root
    return root


def artifacts_from_config(cfg: DictConfig) -> Artifacts:
    return Artifacts(resolve_root(cfg.artifacts_root))
