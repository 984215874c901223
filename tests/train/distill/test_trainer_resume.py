"""Exact resume of the distill trainer: a SIGKILLed run, resumed, logs the uninterrupted run's losses."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from distill_fixtures import toy_records, train_toy

from draftsmith.train.distill import checkpoint as ckpt


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted")
    done = train_toy(out)
    assert done.returncode == 0, done.stderr
    return out


def test_killed_run_resumes_on_the_same_loss_trajectory(uninterrupted: Path, tmp_path: Path) -> None:
    """SIGKILL in the middle of step 7 (second micro-batch of its accumulation window; checkpoint at
    step 4, mid-epoch), then a plain relaunch: the resumed run's metrics.jsonl equals the uninterrupted
    run's record for record (train losses per component, lr, grad norm, eval accuracies), bit for bit,
    and the final weights are identical. The toy objective draws from torch, python and numpy RNGs and
    uses dropout, so this needs model, optimizer, scheduler, all RNG streams and the data position."""
    killed = train_toy(tmp_path, "--kill-at-train-call", "14")
    assert killed.returncode == -9, killed.stderr
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "checkpoints")] == ["step-00000004"]
    assert max(r["step"] for r in toy_records(tmp_path)) == 6  # it logged past the checkpoint before dying

    resumed = train_toy(tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert toy_records(tmp_path) == toy_records(uninterrupted)
    for name, tensor in torch.load(uninterrupted / "params_rank0.pt", weights_only=True).items():
        assert torch.equal(tensor, torch.load(tmp_path / "params_rank0.pt", weights_only=True)[name]), name


def test_keep_last_and_completeness(uninterrupted: Path) -> None:
    """keep_last=2 leaves the two newest checkpoints (steps 8 and the final 9), no temp dirs,
    and each holds the data-loader position that continues the stream."""
    root = uninterrupted / "checkpoints"
    assert [p.name for p in ckpt.list_checkpoints(root)] == ["step-00000008", "step-00000009"]
    assert not [p for p in root.iterdir() if p.name.startswith(".")]
    state = ckpt.read_trainer_state(root / "step-00000008")
    # 24 examples / batch 4 = 6 micro-batches per epoch; 8 steps x 2 micro-batches = 16 = 2 epochs + 4.
    assert (state.step, state.epoch, state.batches_consumed) == (8, 2, 4)


def test_resume_with_another_config_is_refused(uninterrupted: Path, tmp_path: Path) -> None:
    """A resume under a config that changes the trajectory (here the accumulation) fails before
    training with a ValueError naming the differing key; the checkpoint stays as it was."""
    import shutil

    shutil.copytree(uninterrupted / "checkpoints", tmp_path / "checkpoints")
    run = train_toy(tmp_path, "--accum", "1", "--max-steps", "12")
    report = json.loads((tmp_path / "report_rank0.json").read_text())
    assert run.returncode == 0, run.stderr
    assert report["error"] == "ValueError"
    assert "train.gradient_accumulation_steps: 2 -> 1" in report["message"]
    assert "train.max_steps: 9 -> 12" in report["message"]
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "checkpoints")] == ["step-00000008", "step-00000009"]


def test_rng_state_round_trip_needs_no_pickle(tmp_path: Path) -> None:
    """capture/restore of python, numpy and torch RNG survives the safetensors + JSON state files."""
    import random

    import numpy as np

    from draftsmith.train.distill.state_io import load_state_tree, save_state_tree

    state = ckpt.capture_rng_state()
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    save_state_tree(state, tmp_path, "rng")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rng.json", "rng.safetensors"]
    ckpt.restore_rng_state(load_state_tree(tmp_path, "rng"))
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected
