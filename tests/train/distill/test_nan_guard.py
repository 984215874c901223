"""The NaN guard: a non-finite loss stops training with its step and batch, before any update,
and leaves the last good checkpoint intact (one process, and one bad rank out of two)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from distill_fixtures import TOY, free_port, run_job

from draftsmith.train.distill import checkpoint as ckpt
from draftsmith.train.distill.launch import LauncherConfig, relaunch_command



def _digest(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_nan_loss_stops_with_step_and_batch_and_keeps_checkpoint(tmp_path: Path) -> None:
    """NaN injected into the 11th training micro-batch (accum 2: step 6, first micro-batch; 6 batches
    per epoch: epoch 1, batch 4). The run stops with exactly that step/batch in the error, no step-6
    checkpoint appears, step-4 is byte-identical to what was written before the failure and finite,
    and nothing past step 5 was logged."""
    args = [sys.executable, str(TOY), "--out", str(tmp_path), "--max-steps", "9", "--checkpoint-every", "2",
            "--accum", "2", "--nan-at-train-call", "11"]
    done = run_job(args, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "report_rank0.json").read_text())
    assert report["error"] == "NonFiniteLossError"
    assert (report["step"], report["batch_index"]) == (6, 4)
    assert "step 6 (epoch 1, batch 4)" in report["message"] and "loss" in report["message"]
    assert "step-00000004" in report["message"]

    root = tmp_path / "checkpoints"
    assert [p.name for p in ckpt.list_checkpoints(root)] == ["step-00000002", "step-00000004"]
    assert not [p for p in root.iterdir() if p.name.startswith(".")]
    weights = load_file(root / "step-00000004" / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in weights.values())
    assert ckpt.read_trainer_state(root / "step-00000004").step == 4
    logged = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert max(logged) == 5


def test_nan_on_one_rank_stops_both(tmp_path: Path) -> None:
    """With 2 DDP ranks and a NaN on rank 1 only, both ranks stop at the same step (no hang in the
    gradient all-reduce); rank 1 names the loss, rank 0 says it came from another rank."""
    launcher = LauncherConfig(strategy="ddp", num_processes=2, main_process_port=free_port())
    command = relaunch_command(
        launcher,
        ["--out", str(tmp_path), "--strategy", "ddp", "--batch-size", "2", "--max-steps", "6",
         "--nan-at-train-call", "5", "--nan-rank", "1"],
        module="tests.distill_toy",
    )
    done = run_job(command, timeout=180)
    assert done.returncode == 0, done.stderr[-4000:]
    reports = [json.loads((tmp_path / f"report_rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["error"] for r in reports] == ["NonFiniteLossError"] * 2
    assert [r["step"] for r in reports] == [3, 3]
    assert "on another rank" in reports[0]["message"]
    assert "loss" in reports[1]["message"]
