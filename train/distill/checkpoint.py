"""Atomic, resumable training checkpoints.

Layout of ``<root>/step-00000120/`` (a directory only ever appears under that name by a rename, so a
``step-*`` directory is always complete; a kill mid-write leaves only a ``.tmp-*`` directory behind):

  trainer_state.json   step, loader position (epoch, batches consumed), world size, config hash
  run_config.json      the hashed config, to name the differing keys when a resume does not match
  model.safetensors    full (unsharded) trainable-module weights          } plain / DDP
  optimizer.pt         optimizer.state_dict()                            }
  accelerate_state/    accelerator.save_state output                     } FSDP / DeepSpeed (sharded)
  scheduler.pt         LR scheduler state
  rng_rank{r}.pt       python / numpy / torch (/cuda) RNG states of rank r

Everything is loaded with ``torch.load(weights_only=True)`` or safetensors: no pickle.
The checkpoint root must be on a filesystem all ranks share (a cluster's shared FS).
"""
from __future__ import annotations

import hashlib
import json
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

CHECKPOINT_PREFIX = "step-"
STATE_FILE = "trainer_state.json"
CONFIG_FILE = "run_config.json"


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
    canonical = json.dumps(config, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _differing_keys(saved: Any, current: Any, prefix: str = "") -> list[str]:
    if isinstance(saved, Mapping) and isinstance(current, Mapping):
        keys = sorted(set(saved) | set(current))
        return [d for k in keys for d in _differing_keys(saved.get(k), current.get(k), f"{prefix}{k}.")]
    return [] if saved == current else [f"{prefix.rstrip('.')}: {saved!r} -> {current!r}"]


# ---------------------------------------------------------------- RNG (weights_only-safe encoding)


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
    """Complete checkpoints under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.iterdir()
        if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX) and p.name[len(CHECKPOINT_PREFIX) :].isdigit()
        and (p / STATE_FILE).is_file()
    ]
    return sorted(found, key=_step_of)


def latest_checkpoint(root: str | Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


# ---------------------------------------------------------------- save / load


def _fsync_tree(path: Path) -> None:
    for file in path.rglob("*"):
        if file.is_file():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())


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
    """Write checkpoint `step-{state.step}` atomically; all ranks must call it. Returns its path."""
    root = Path(root)
    name = f"{CHECKPOINT_PREFIX}{state.step:08d}"
    final, tmp = root / name, root / f".tmp-{name}"
    is_main = accelerator.is_main_process
    if is_main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed mid-save
        tmp.mkdir()
    accelerator.wait_for_everyone()

    torch.save(capture_rng_state(), tmp / f"rng_rank{accelerator.process_index}.pt")
    if sharded:
        accelerator.save_state(str(tmp / "accelerate_state"))  # collective: every rank writes its shard
    elif is_main:
        save_model(accelerator.unwrap_model(model), str(tmp / "model.safetensors"))
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    accelerator.wait_for_everyone()

    if is_main:
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        (tmp / CONFIG_FILE).write_text(json.dumps(run_config, sort_keys=True, indent=1, default=str))
        (tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=1))  # last: marks completeness
        _fsync_tree(tmp)
        stale = root / f".old-{name}"
        if final.exists():  # re-saving a step (e.g. a final save right after a resume): keep it until swapped
            os.replace(final, stale)
        os.replace(tmp, final)
        shutil.rmtree(stale, ignore_errors=True)
        dir_fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        if keep_last > 0:
            for old in list_checkpoints(root)[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
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
    """Restore everything `save_checkpoint` wrote into the live objects; returns the trainer state."""
    path = Path(path)
    state = check_compatible(path, config_hash, run_config, accelerator.num_processes)
    if sharded != (path / "accelerate_state").is_dir():  # e.g. a DDP checkpoint resumed under DeepSpeed
        layouts = ("sharded (accelerate_state/, FSDP or DeepSpeed)", "full (model.safetensors, local or DDP)")
        raise ValueError(f"cannot resume from {path}: it holds a {layouts[not (path / 'accelerate_state').is_dir()]} "
                         f"checkpoint, this run's launcher needs a {layouts[not sharded]} one; use the launcher "
                         "that wrote it or a fresh train.output_dir")
    if sharded:
        accelerator.load_state(str(path / "accelerate_state"))
    else:
        load_model(accelerator.unwrap_model(model), str(path / "model.safetensors"), strict=True)
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", map_location="cpu", weights_only=True))
    rng_file = path / f"rng_rank{accelerator.process_index}.pt"
    if not rng_file.is_file():
        raise ValueError(f"cannot resume from {path}: missing {rng_file.name}")
    # Restored last: accelerate's load_state also restores (its own copy of) RNG state.
    restore_rng_state(torch.load(rng_file, weights_only=True))
    return state
