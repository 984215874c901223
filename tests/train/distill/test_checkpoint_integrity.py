"""Checkpoints that survive corruption: a manifest written last, verified on resume, no pickle.

A run SIGKILLed in step 9 leaves checkpoints 4 and 8. Corrupting 8 (truncated, overwritten in place,
or its manifest gone = partial) must not crash the resume: it is reported and skipped, the run goes
on from 4 and logs the uninterrupted run's losses bit for bit. With no intact checkpoint the run
stops with one line naming the dir.
"""
from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from distill_fixtures import toy_records, train_toy

from draftsmith.train.distill import checkpoint as ckpt
from draftsmith.train.distill.manifest import MANIFEST_FILE


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _overwrite_in_place(path: Path) -> None:
    """Same size, different tensor bytes: a header check alone would not notice."""
    data = bytearray(path.read_bytes())
    data[-64:] = bytes(b ^ 0xFF for b in data[-64:])
    path.write_bytes(bytes(data))


CORRUPTIONS = {
    "truncated": lambda d: _truncate(d / "model.safetensors"),
    "overwritten": lambda d: _overwrite_in_place(d / "model.safetensors"),
    "partial": lambda d: (d / MANIFEST_FILE).unlink(),
}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted")
    done = train_toy(out)
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> Path:
    """Killed in step 9 (train call 17 of 2 per step): checkpoints 4 and 8 on disk."""
    out = tmp_path_factory.mktemp("killed")
    run = train_toy(out, "--kill-at-train-call", "17")
    assert run.returncode == -9, run.stderr
    assert [p.name for p in ckpt.list_checkpoints(out / "checkpoints")] == ["step-00000004", "step-00000008"]
    return out


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_corrupt_newest_checkpoint_is_skipped_and_the_curve_reproduced(
    corruption: str, uninterrupted: Path, killed: Path, tmp_path: Path
) -> None:
    """The resume names the bad checkpoint and why, continues from step 4, and ends with the
    uninterrupted run's metrics and weights exactly; the re-saved step 8 is intact again."""
    run_dir = tmp_path / "run"
    shutil.copytree(killed, run_dir)
    newest = run_dir / "checkpoints" / "step-00000008"
    CORRUPTIONS[corruption](newest)

    resumed = train_toy(run_dir)
    assert resumed.returncode == 0, resumed.stderr
    report = json.loads((run_dir / "report_rank0.json").read_text())
    assert "error" not in report, report
    skipped = [line for line in resumed.stderr.splitlines() if "status=checkpoint_skipped" in line]
    assert len(skipped) == 1 and str(newest) in skipped[0], resumed.stderr
    assert ("MANIFEST.json" if corruption == "partial" else "model.safetensors") in skipped[0]
    assert toy_records(run_dir) == toy_records(uninterrupted)
    expected = torch.load(uninterrupted / "params_rank0.pt", weights_only=True)
    got = torch.load(run_dir / "params_rank0.pt", weights_only=True)
    assert all(torch.equal(expected[name], got[name]) for name in expected)
    assert ckpt.verified_checkpoint(newest) == newest


def test_no_intact_checkpoint_stops_with_one_line(killed: Path, tmp_path: Path) -> None:
    """Both checkpoints bad: the run stops before training with one ValueError line naming the
    checkpoint dir (the CLI prints ValueErrors as one line), no safetensors traceback, nothing rewritten."""
    run_dir = tmp_path / "run"
    shutil.copytree(killed, run_dir)
    root = run_dir / "checkpoints"
    _truncate(root / "step-00000004" / "optimizer.safetensors")
    (root / "step-00000008" / MANIFEST_FILE).unlink()
    before = (run_dir / "metrics.jsonl").read_text()

    run = train_toy(run_dir)
    report = json.loads((run_dir / "report_rank0.json").read_text())
    assert report["error"] == "CorruptCheckpointError" and issubclass(ckpt.CorruptCheckpointError, ValueError)
    assert "\n" not in report["message"] and str(root) in report["message"], report["message"]
    assert "SafetensorError" not in run.stderr + report["message"]
    assert [p.name for p in ckpt.list_checkpoints(root)] == ["step-00000004", "step-00000008"]
    assert (run_dir / "metrics.jsonl").read_text() == before


# ---------------------------------------------------------------- in-process: files, pickle, pruning


def _fake_accelerator() -> SimpleNamespace:
    return SimpleNamespace(is_main_process=True, process_index=0, num_processes=1,
                           wait_for_everyone=lambda: None, unwrap_model=lambda m: m)


def _trained_objects(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.9))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    for _ in range(3):
        model(torch.randn(5, 4)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return model, optimizer, scheduler


def _save(root: Path, step: int, objects: tuple, keep_last: int = 0) -> Path:
    model, optimizer, scheduler = objects
    state = ckpt.TrainerState(step, 0, step, 1, "hash")
    return ckpt.save_checkpoint(root, state, {"k": 1}, accelerator=_fake_accelerator(), model=model,
                                optimizer=optimizer, scheduler=scheduler, sharded=False, keep_last=keep_last)


def test_resume_state_is_tensors_and_json_and_loads_without_unpickling(tmp_path: Path, monkeypatch) -> None:
    """Every checkpoint file is JSON or safetensors, and loading restores optimizer, scheduler and
    RNG exactly while any unpickling (torch.load, pickle.load/loads) would raise."""
    saved = _trained_objects(seed=0)
    path = _save(tmp_path, 3, saved)
    assert {p.suffix for p in path.iterdir()} == {".json", ".safetensors"}
    assert json.loads((path / MANIFEST_FILE).read_text())["files"].keys() == {
        p.name for p in path.iterdir() if p.name != MANIFEST_FILE}
    after_save = torch.rand(3)

    def no_unpickling(*args, **kwargs):
        raise AssertionError("resume unpickled something")

    for target, name in ((torch, "load"), (pickle, "load"), (pickle, "loads")):
        monkeypatch.setattr(target, name, no_unpickling)
    model, optimizer, scheduler = _trained_objects(seed=1)
    state = ckpt.load_checkpoint(path, config_hash="hash", run_config={"k": 1}, accelerator=_fake_accelerator(),
                                 model=model, optimizer=optimizer, scheduler=scheduler, sharded=False)
    assert state.step == 3 and torch.equal(torch.rand(3), after_save)
    assert scheduler.state_dict() == saved[2].state_dict()
    got, want = optimizer.state_dict(), saved[1].state_dict()
    assert got["param_groups"] == want["param_groups"] and isinstance(got["param_groups"][0]["betas"], tuple)
    for index, slots in want["state"].items():
        assert all(torch.equal(slots[k], got["state"][index][k]) for k in slots), index


def test_explicit_resume_dir_is_verified(tmp_path: Path) -> None:
    """train.resume=<dir> pointing at a corrupt checkpoint fails in one line naming it and the file."""
    path = _save(tmp_path, 2, _trained_objects(seed=0))
    _overwrite_in_place(path / "optimizer.safetensors")
    with pytest.raises(ckpt.CorruptCheckpointError, match=r"step-00000002: optimizer.safetensors does not match"):
        ckpt.resume_checkpoint(tmp_path, str(path), _fake_accelerator())


def test_pruning_never_keeps_a_skipped_newer_checkpoint_over_the_new_one(tmp_path: Path) -> None:
    """Resumed from 4 past a corrupt 8, a save at 6 with keep_last=1 keeps 6 (and leaves 8 to be
    replaced when step 8 is saved again); 6 is then what a resume picks."""
    objects = _trained_objects(seed=0)
    _save(tmp_path, 4, objects)
    _truncate(_save(tmp_path, 8, objects) / "model.safetensors")
    assert ckpt.newest_intact_checkpoint(tmp_path).name == "step-00000004"
    _save(tmp_path, 6, objects, keep_last=1)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-00000006", "step-00000008"]
    assert ckpt.newest_intact_checkpoint(tmp_path).name == "step-00000006"
