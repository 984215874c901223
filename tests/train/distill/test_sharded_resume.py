"""Sharded launchers (DeepSpeed ZeRO-2, ZeRO-3, FSDP2) on 2 gloo ranks: train, SIGKILL mid-step, resume,
export the gathered weights, load them.

For each launcher two runs start at once: an uninterrupted one and one that kills itself in step 3 (the
checkpoint of step 2 is on disk). The killed one is then relaunched and resumes. The resumed run must log
the uninterrupted run's records bit for bit (so model shards, optimizer shards, scheduler, RNG streams and
the data position all came back), and its exported weights, gathered onto rank 0, must equal the
uninterrupted run's and load strictly into a fresh draft. All runs of a wave share the 2 cores (each
launch waits mostly on imports), which keeps the file to two waves of process launches.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from distill_fixtures import HAS_DEEPSPEED, free_port, start_job, wait_jobs
from distill_toy import ToyDraft

from draftsmith.train.distill import checkpoint as ckpt
from draftsmith.train.distill.launch import LauncherConfig, relaunch_command

# launcher name -> (toy --strategy, --zero-stage, distributed type accelerate must report)
LAUNCHERS = {
    "deepspeed_zero2": ("deepspeed", "2", "DistributedType.DEEPSPEED"),
    "deepspeed_zero3": ("deepspeed", "3", "DistributedType.DEEPSPEED"),
    "fsdp": ("fsdp", "2", "DistributedType.FSDP"),
}
TRAIN = ("--max-steps", "4", "--checkpoint-every", "2", "--eval-every", "2", "--accum", "1", "--batch-size", "2")
KILL_AT = "3"  # accum 1: the third micro-batch is step 3, after the step-2 checkpoint


def _start(out: Path, launcher: str, *extra: str) -> tuple[subprocess.Popen, Path]:
    strategy, zero_stage, _ = LAUNCHERS[launcher]
    config = LauncherConfig(name=launcher, strategy=strategy, num_processes=2, main_process_port=free_port())
    argv = ["--out", str(out), "--strategy", strategy, "--zero-stage", zero_stage, *TRAIN, *extra]
    command = relaunch_command(config, argv, module="tests.distill_toy")
    assert command is not None
    out.mkdir(parents=True, exist_ok=True)
    log = out.parent / f"{out.name}.log"
    return start_job(command, log), log


def _wait(started: dict[str, tuple[subprocess.Popen, Path]]) -> dict[str, tuple[int, str]]:
    codes = wait_jobs({key: proc for key, (proc, _) in started.items()}, timeout=300)
    return {key: (codes[key], log.read_text()) for key, (_, log) in started.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{launcher: (uninterrupted dir, resumed dir, {run name: (returncode, log)})}."""
    launchers = [name for name in LAUNCHERS if LAUNCHERS[name][0] != "deepspeed" or HAS_DEEPSPEED]
    tmp = tmp_path_factory.mktemp("sharded")
    first = {}
    for name in launchers:
        first[f"{name}/full"] = _start(tmp / name / "full", name)
        first[f"{name}/killed"] = _start(tmp / name / "resumed", name, "--kill-at-train-call", KILL_AT)
    results = _wait(first)
    killed_checkpoints = {name: [p.name for p in ckpt.list_checkpoints(tmp / name / "resumed" / "checkpoints")]
                          for name in launchers}
    results.update(_wait({f"{name}/resumed": _start(tmp / name / "resumed", name) for name in launchers}))
    return {name: (tmp / name / "full", tmp / name / "resumed", results, killed_checkpoints[name]) for name in launchers}


def _records(out: Path) -> list[dict]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        record.pop("tokens_per_s", None)  # wall-clock dependent; everything else must match exactly
    return records


def _reports(out: Path) -> list[dict]:
    return [json.loads((out / f"report_rank{rank}.json").read_text()) for rank in (0, 1)]


def _run(runs, launcher: str):
    if launcher not in runs:
        pytest.skip("deepspeed is not installed (scripts/setup_venv.sh installs it; DRAFTSMITH_SKIP_DEEPSPEED=1 skips it)")
    full, resumed, results, killed_checkpoints = runs[launcher]
    for key in (f"{launcher}/full", f"{launcher}/resumed"):
        returncode, log = results[key]
        assert returncode == 0, f"{key}:\n{log[-4000:]}"
    return full, resumed, results, killed_checkpoints


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_killed_sharded_run_resumes_exactly_and_exports(runs, launcher):
    """The killed run died (SIGKILL) holding only the step-2 checkpoint, in accelerate's sharded layout;
    the relaunch resumed from it under the requested strategy and logged the uninterrupted run's records
    exactly; both ranks ended at step 4; the weights gathered for export are the uninterrupted run's and
    load strictly into a fresh draft."""
    full, resumed, results, killed_checkpoints = _run(runs, launcher)
    assert results[f"{launcher}/killed"][0] != 0
    assert killed_checkpoints == ["step-00000002"]
    assert (resumed / "checkpoints" / "step-00000002" / "accelerate_state").is_dir()  # sharded save ran

    reports = _reports(resumed)
    expected_type = LAUNCHERS[launcher][2]
    assert [(r["rank"], r["world_size"], r["distributed_type"]) for r in reports] == [(0, 2, expected_type), (1, 2, expected_type)]
    assert all("error" not in r for r in reports), reports
    assert [r["step"] for r in reports] == [4, 4]
    assert len(reports[0]["seen_example_ids"]) == 2 * 2  # resumed at step 2: two more steps of batch 2
    assert _records(resumed) == _records(full)

    exported = torch.load(resumed / "params_rank0.pt", weights_only=True)
    reference = torch.load(full / "params_rank0.pt", weights_only=True)
    assert exported.keys() == reference.keys() and exported
    for name, tensor in reference.items():
        assert torch.equal(exported[name], tensor), name
    draft = ToyDraft()
    draft.load_state_dict(exported, strict=True)  # full, unsharded shapes: the export is usable as is
    assert all(torch.isfinite(p).all() for p in draft.parameters())


def test_zero3_plugin_gathers_weights_for_export_and_fsdp2_strategies_are_checked():
    """The ZeRO-3 plugin asks DeepSpeed to gather full weights on save (export needs them; ZeRO-2 holds
    full parameters anyway); FSDP2 has no NO_SHARD/HYBRID_SHARD, which validate names."""
    from draftsmith.train.distill.launch import _deepspeed_plugin

    with pytest.raises(ValueError, match="launcher.fsdp_sharding_strategy"):
        LauncherConfig(strategy="fsdp", num_processes=2, fsdp_sharding_strategy="NO_SHARD").validate()
    if not HAS_DEEPSPEED:
        pytest.skip("deepspeed is not installed")
    for stage, gathers in ((3, True), (2, False)):
        plugin = _deepspeed_plugin(LauncherConfig(strategy="deepspeed", num_processes=2, zero_stage=stage), 2, 1, None)
        assert plugin.deepspeed_config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is gathers
