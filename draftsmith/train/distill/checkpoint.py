"""Atomic, verified, resumable training checkpoints.

Layout of ``<root>/step-00000120/`` (a directory only ever appears under that name by a rename; a kill
mid-write leaves only a ``.tmp-*`` directory behind):

  trainer_state.json   step, loader position (epoch, batches consumed), world size, config hash
  run_config.json      the hashed config, to name the differing keys when a resume does not match
  model.safetensors    full (unsharded) trainable-module weights                   } plain / DDP
  optimizer.{json,safetensors}  optimizer.state_dict()                            }
  accelerate_state/    accelerator.save_state output                               } FSDP / DeepSpeed (sharded)
  scheduler.{json,safetensors}  LR scheduler state
  rng_rank{r}.{json,safetensors}  python / numpy / torch (/cuda) RNG states of rank r
  MANIFEST.json        size + sha256 of every other file, written last (see manifest.py)

Our own state goes through state_io (tensors in safetensors, the rest in JSON): resume never
unpickles it. Under FSDP / DeepSpeed the model and optimizer shards in accelerate_state/ are the
library's own format (DeepSpeed ``.pt`` files, torch.distributed.checkpoint metadata), read by the
library; accelerate's pickled RNG file is deleted there, so only ours is restored. Every file, theirs
included, is checked against the manifest before anything is loaded. A corrupt or partial newest
checkpoint is skipped (with a warning naming it) for the newest intact one.
The checkpoint root must be on a filesystem all ranks share (a cluster's shared FS).
"""
from __future__ import annotations

import json
import logging
import os
import random
import shutil
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_model, save_model

from draftsmith.drafts.files import stable_hash
from draftsmith.train.distill.manifest import verify_manifest, write_manifest
from draftsmith.train.distill.state_io import load_state_tree, save_state_tree
from draftsmith.train.logs import format_fields

CHECKPOINT_PREFIX = "step-"
STATE_FILE = "trainer_state.json"
CONFIG_FILE = "run_config.json"
ACCELERATE_DIR = "accelerate_state"
logger = logging.getLogger("draftsmith")


class CorruptCheckpointError(ValueError):
    """No checkpoint this run may resume from is intact; the message is one line naming the dir."""


@dataclass
class TrainerState:
    """Where training stands after `step` optimizer steps."""

    step: int
    epoch: int  # epoch of the next micro-batch
    batches_consumed: int  # micro-batches of `epoch` already trained on (per rank)
    world_size: int
    config_hash: str


def config_fingerprint(config: Mapping[str, Any]) -> str:
    """sha256 of the config as canonical JSON (sorted keys); non-JSON leaves go through str()."""
    return stable_hash(dict(config))


def _differing_keys(saved: Any, current: Any, prefix: str = "") -> list[str]:
    if isinstance(saved, Mapping) and isinstance(current, Mapping):
        keys = sorted(set(saved) | set(current))
        return [d for k in keys for d in _differing_keys(saved.get(k), current.get(k), f"{prefix}{k}.")]
    return [] if saved == current else [f"{prefix.rstrip('.')}: {saved!r} -> {current!r}"]


# ---------------------------------------------------------------- RNG (tensors + scalars: stored by state_io)


def capture_rng_state() -> dict[str, Any]:
    version, mt_state, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python_version": version,
        "python_state": torch.tensor(mt_state, dtype=torch.int64),
        "python_gauss": gauss,
        "numpy_name": np_name,
        "numpy_keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
        "numpy_pos": int(np_pos),
        "numpy_has_gauss": int(np_has_gauss),
        "numpy_gauss": float(np_gauss),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    random.setstate((state["python_version"], tuple(state["python_state"].tolist()), state["python_gauss"]))
    np.random.set_state(
        (
            state["numpy_name"],
            state["numpy_keys"].numpy().astype(np.uint32),
            state["numpy_pos"],
            state["numpy_has_gauss"],
            state["numpy_gauss"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------- discovery


def _step_of(path: Path) -> int:
    return int(path.name[len(CHECKPOINT_PREFIX) :])


def list_checkpoints(root: str | Path) -> list[Path]:
    """Checkpoint dirs under `root` (intact or not: see `newest_intact_checkpoint`), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX) and p.name[len(CHECKPOINT_PREFIX) :].isdigit()
    ]
    return sorted(found, key=_step_of)


def latest_checkpoint(root: str | Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def verified_checkpoint(path: str | Path) -> Path:
    """`path` when its manifest checks out, else CorruptCheckpointError naming it and the problem."""
    path = Path(path)
    if not path.is_dir():
        raise CorruptCheckpointError(f"cannot resume from {path}: not a directory")
    problem = verify_manifest(path)
    if problem is not None:
        raise CorruptCheckpointError(f"cannot resume from {path}: {problem}")
    return path


def newest_intact_checkpoint(root: str | Path) -> Path | None:
    """The newest checkpoint under `root` whose manifest checks out; each newer one that does not is
    logged (path + problem) and skipped. None when `root` holds none at all; CorruptCheckpointError
    when it holds some but none is intact (starting over would silently throw their training away)."""
    found = list_checkpoints(root)
    problems: list[str] = []
    for path in reversed(found):
        problem = verify_manifest(path)
        if problem is None:
            return path
        problems.append(problem)
        logger.warning("draftsmith %s", format_fields(stage="distill", status="checkpoint_skipped",
                                                      checkpoint=str(path), reason=problem))
    if not found:
        return None
    raise CorruptCheckpointError(
        f"no intact checkpoint under {Path(root)}: all {len(found)} are corrupt or partial (newest "
        f"{found[-1].name}: {problems[0]}); move them aside or use a fresh train.output_dir"
    )


def resume_checkpoint(root: str | Path, resume: str, accelerator: Any) -> Path | None:
    """The checkpoint every rank resumes from (`resume`: auto | <checkpoint dir>), None = a fresh start.
    The main process verifies and the others take its answer: hashing is done once, and no rank can
    pick another checkpoint than its peers. A failure is raised on every rank, so none hangs waiting."""
    answer: dict[str, str | None] = {"path": None, "error": None}
    if accelerator.is_main_process:
        try:
            path = newest_intact_checkpoint(root) if resume == "auto" else verified_checkpoint(resume)
            answer["path"] = None if path is None else str(path)
        except CorruptCheckpointError as err:
            answer["error"] = str(err)
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        answer = broadcast_object_list([answer], from_process=0)[0]
    if answer["error"] is not None:
        raise CorruptCheckpointError(answer["error"])
    return None if answer["path"] is None else Path(answer["path"])


# ---------------------------------------------------------------- save / load


def _fsync_tree(path: Path) -> None:
    for file in path.rglob("*"):
        if file.is_file():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())


def _write_rank_files(tmp: Path, accelerator: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                      sharded: bool) -> None:
    """What each rank contributes: its RNG streams, and model + optimizer (all shards, or main's full copy)."""
    rank = accelerator.process_index
    save_state_tree(capture_rng_state(), tmp, f"rng_rank{rank}")
    if sharded:
        accelerator.save_state(str(tmp / ACCELERATE_DIR))  # collective: every rank writes its shard
        # accelerate's RNG copy is a pickle; ours (restored last anyway) makes it redundant.
        (tmp / ACCELERATE_DIR / f"random_states_{rank}.pkl").unlink(missing_ok=True)
    elif accelerator.is_main_process:
        save_model(accelerator.unwrap_model(model), str(tmp / "model.safetensors"))
        save_state_tree(optimizer.state_dict(), tmp, "optimizer")


def _publish(tmp: Path, final: Path, keep_last: int) -> None:
    """Rename the finished temp dir into place (durably), then prune the oldest checkpoints."""
    root, stale = final.parent, final.parent / f".old-{final.name}"
    if final.exists():  # re-saving a step (a final save right after a resume, a corrupt dir): swap it out
        os.replace(final, stale)
    os.replace(tmp, final)
    shutil.rmtree(stale, ignore_errors=True)
    dir_fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    if keep_last > 0:
        # Only checkpoints up to this one count: a newer one can only be a corrupt one this run skipped,
        # and counting it could delete the checkpoint just written while keeping the broken one.
        older = [p for p in list_checkpoints(root) if _step_of(p) <= _step_of(final)]
        for old in older[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(
    root: str | Path,
    state: TrainerState,
    run_config: Mapping[str, Any],
    *,
    accelerator: Any,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    sharded: bool,
    keep_last: int,
) -> Path:
    """Write checkpoint `step-{state.step}` atomically, manifest last; all ranks must call it. Returns its path."""
    root = Path(root)
    name = f"{CHECKPOINT_PREFIX}{state.step:08d}"
    final, tmp = root / name, root / f".tmp-{name}"
    is_main = accelerator.is_main_process
    if is_main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed mid-save
        tmp.mkdir()
    accelerator.wait_for_everyone()
    _write_rank_files(tmp, accelerator, model, optimizer, sharded)
    accelerator.wait_for_everyone()
    if is_main:
        save_state_tree(scheduler.state_dict(), tmp, "scheduler")
        (tmp / CONFIG_FILE).write_text(json.dumps(run_config, sort_keys=True, indent=1, default=str))
        (tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=1))
        _fsync_tree(tmp)
        write_manifest(tmp)  # last: hashes what is on disk, every rank's files included
        _publish(tmp, final, keep_last)
    accelerator.wait_for_everyone()
    return final


def read_trainer_state(path: str | Path) -> TrainerState:
    path = Path(path)
    if not (path / STATE_FILE).is_file():
        raise ValueError(f"{path} is not a checkpoint: no {STATE_FILE}")
    return TrainerState(**json.loads((path / STATE_FILE).read_text()))


def check_compatible(path: str | Path, config_hash: str, run_config: Mapping[str, Any], world_size: int) -> TrainerState:
    """The checkpoint's state, or a ValueError saying why this run cannot continue it."""
    path = Path(path)
    state = read_trainer_state(path)
    if state.config_hash != config_hash:
        saved_config = json.loads((path / CONFIG_FILE).read_text()) if (path / CONFIG_FILE).is_file() else {}
        differences = _differing_keys(saved_config, json.loads(json.dumps(run_config, default=str)))
        raise ValueError(
            f"cannot resume from {path}: it was written by config {state.config_hash}, this run's config is "
            f"{config_hash}; differing keys: {'; '.join(differences) or 'unknown'}. "
            "Resume with the same config or use a fresh output directory."
        )
    if state.world_size != world_size:
        raise ValueError(
            f"cannot resume from {path}: it was written with world_size {state.world_size}, this run has "
            f"{world_size} (the data-loader position is per rank); relaunch with {state.world_size} processes"
        )
    return state


def load_checkpoint(
    path: str | Path,
    *,
    config_hash: str,
    run_config: Mapping[str, Any],
    accelerator: Any,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    sharded: bool,
) -> TrainerState:
    """Restore everything `save_checkpoint` wrote into the live objects; returns the trainer state.
    `path` should come from `resume_checkpoint` (manifest verified): nothing here re-hashes it."""
    path = Path(path)
    state = check_compatible(path, config_hash, run_config, accelerator.num_processes)
    if sharded != (path / ACCELERATE_DIR).is_dir():  # e.g. a DDP checkpoint resumed under DeepSpeed
        layouts = ("sharded (accelerate_state/, FSDP or DeepSpeed)", "full (model.safetensors, local or DDP)")
        raise ValueError(f"cannot resume from {path}: it holds a {layouts[not (path / ACCELERATE_DIR).is_dir()]} "
                         f"checkpoint, this run's launcher needs a {layouts[not sharded]} one; use the launcher "
                         "that wrote it or a fresh train.output_dir")
    if sharded:
        accelerator.load_state(str(path / ACCELERATE_DIR))
    else:
        load_model(accelerator.unwrap_model(model), str(path / "model.safetensors"), strict=True)
        optimizer.load_state_dict(load_state_tree(path, "optimizer"))
    scheduler.load_state_dict(load_state_tree(path, "scheduler"))
    # Restored last: accelerate's load_state may also touch the RNG streams.
    restore_rng_state(load_state_tree(path, f"rng_rank{accelerator.process_index}"))
    return state
