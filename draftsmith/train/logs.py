"""Logging for every job: one structured line per stage, progress bars with ETA, W&B (offline by default).

Named ``logs`` (not ``logging``) so it never shadows the standard library module.

Stage lines are ``key=value`` pairs a script can grep::

    draftsmith stage=target status=done wall_s=412.3 cached=false steps=600
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

T = TypeVar("T")
logger = logging.getLogger("draftsmith")


def _format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    text = str(value)
    return f'"{text}"' if (" " in text or not text) else text


def format_fields(**fields: Any) -> str:
    return " ".join(f"{key}={_format_value(value)}" for key, value in fields.items())


def log_event(**fields: Any) -> None:
    """One structured line (goes through Hydra's job logging: console + the run's log file)."""
    logger.info("draftsmith %s", format_fields(**fields))


def warn_event(**fields: Any) -> None:
    """A structured line at WARNING level: a cap cut in, a setting wastes the draft."""
    logger.warning("draftsmith %s", format_fields(**fields))


@contextlib.contextmanager
def stage(name: str) -> Iterator[dict[str, Any]]:
    """Time a stage; fields put in the yielded dict are appended to its closing line."""
    fields: dict[str, Any] = {}
    log_event(stage=name, status="start")
    start = time.perf_counter()
    try:
        yield fields
    except BaseException:
        log_event(stage=name, status="failed", wall_s=time.perf_counter() - start)
        raise
    fields["wall_s"] = round(time.perf_counter() - start, 3)
    log_event(stage=name, status="done", **fields)


_BAR_LANE: tuple[int, str] | None = None   # (terminal line, name) of this process's bars; None: line 0, unnamed


def progress_lane(position: int, name: str) -> None:
    """This process's bars from now on sit on terminal line ``position`` and carry ``name``: workers that train
    side by side (train.pipeline.side_by_side) each keep their own line instead of overwriting one."""
    global _BAR_LANE
    _BAR_LANE = (position, name)


def progress(iterable: Iterable[T] | None = None, total: int | None = None, desc: str = "", **kwargs: Any) -> tqdm:
    """tqdm bar with ETA (elapsed<remaining) on stderr; quiet when DRAFTSMITH_NO_PROGRESS is set."""
    disable = bool(os.environ.get("DRAFTSMITH_NO_PROGRESS"))
    if _BAR_LANE is not None:
        kwargs.setdefault("position", _BAR_LANE[0])
        desc = f"{desc} {_BAR_LANE[1]}".strip()
    return tqdm(iterable, total=total, desc=desc, file=sys.stderr, disable=disable, dynamic_ncols=True, **kwargs)


class _NullRun:
    """Stand-in when W&B is disabled: same calls, no effect."""

    def log(self, *args: Any, **kwargs: Any) -> None:
        pass

    def finish(self) -> None:
        pass

    @property
    def summary(self) -> dict[str, Any]:
        return {}


@dataclass(frozen=True)
class WandbSettings:
    """Where W&B runs go (the config's ``wandb`` group): offline unless the user says otherwise."""

    mode: str = "offline"
    project: str = "draftsmith"
    entity: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("offline", "online", "disabled"):
            raise ValueError(f"wandb.mode: {self.mode!r} is not one of offline, online, disabled")

    @classmethod
    def from_config(cls, cfg: DictConfig) -> "WandbSettings":
        return cls(cfg.wandb.mode, cfg.wandb.project, cfg.wandb.entity)


def start_run(settings: WandbSettings, job_type: str, wandb_dir: Path, name: str | None = None,
              config: dict[str, Any] | None = None, reinit: str = "finish_previous") -> Any:
    """One W&B run (a `_NullRun` when disabled). ``reinit="create_new"`` keeps a run already open in
    this process (a pipeline's) running beside the new one."""
    if settings.mode == "disabled":
        return _NullRun()
    os.environ.setdefault("WANDB_MODE", settings.mode)
    os.environ.setdefault("WANDB_SILENT", "true")
    import wandb

    Path(wandb_dir).mkdir(parents=True, exist_ok=True)
    return wandb.init(mode=settings.mode, project=settings.project, entity=settings.entity, job_type=job_type,
                      name=name, dir=str(wandb_dir), config=config, reinit=reinit)


def init_wandb(cfg: DictConfig, job_type: str, wandb_dir: Path, name: str | None = None) -> Any:
    """Start a job's W&B run in ``cfg.wandb.mode``, with the job's whole config."""
    return start_run(WandbSettings.from_config(cfg), job_type, wandb_dir, name,
                     OmegaConf.to_container(cfg, resolve=True))


def ensure_console_logging() -> None:
    """Outside a Hydra app (tests, notebooks) still show draftsmith's lines."""
    if not logging.getLogger().handlers and not logger.handlers:
        logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s] %(message)s")
