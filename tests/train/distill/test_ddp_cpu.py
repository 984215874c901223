"""2-process data parallel training on CPU (gloo), launched the way `draftsmith distill` launches it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from distill_fixtures import REPO, free_port, run_job

from draftsmith.train.distill.data import ShardedResumableSampler
from draftsmith.train.distill.launch import LauncherConfig, accelerate_config, relaunch_command


def _run_two_ranks(out: Path, strategy: str, *extra: str) -> list[dict]:
    launcher = LauncherConfig(name=strategy, strategy=strategy, num_processes=2, main_process_port=free_port())
    command = relaunch_command(launcher, ["--out", str(out), "--strategy", strategy, *extra], module="tests.distill_toy")
    assert command is not None
    done = run_job(command, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((out / f"report_rank{rank}.json").read_text()) for rank in (0, 1)]


def _check_distributed_run(out: Path, reports: list[dict], steps: int, accum: int, batch_size: int) -> None:
    assert [r["world_size"] for r in reports] == [2, 2] and [r["rank"] for r in reports] == [0, 1]
    assert all("error" not in r for r in reports), reports
    # Data: per optimizer step each rank sees accum x batch_size examples; within each epoch the two
    # ranks' examples are disjoint and together are exactly what the sampler's global batches hold.
    seen = [r["seen_example_ids"] for r in reports]
    assert len(seen[0]) == len(seen[1]) == steps * accum * batch_size
    per_epoch = ShardedResumableSampler(24, batch_size, world_size=2).batches_per_epoch * batch_size
    for start in range(0, len(seen[0]), per_epoch):
        shard0, shard1 = set(seen[0][start : start + per_epoch]), set(seen[1][start : start + per_epoch])
        assert not shard0 & shard1
        assert len(shard0) == len(seen[0][start : start + per_epoch])  # no repeats within an epoch
    # Parameters: identical on both ranks after training, and actually trained.
    params = [torch.load(out / f"params_rank{rank}.pt", weights_only=True) for rank in (0, 1)]
    assert params[0].keys() == params[1].keys()
    for name in params[0]:
        assert torch.equal(params[0][name], params[1][name]), name
    # Eval metrics were reduced over both ranks: both report the same numbers.
    assert reports[0]["final_metrics"] == reports[1]["final_metrics"]
    assert 1.0 <= reports[0]["final_metrics"]["eval/simulated_tau"] <= 3.0


def test_ddp_two_ranks_split_data_and_agree(tmp_path: Path) -> None:
    """torchrun (via relaunch_command) starts 2 gloo ranks; each trains on a disjoint shard of every
    epoch; after 6 accumulated steps the weights on both ranks are bitwise equal; metrics.jsonl is
    written once (rank 0) with world-summed throughput."""
    reports = _run_two_ranks(tmp_path, "ddp", "--max-steps", "6", "--accum", "2", "--batch-size", "2")
    _check_distributed_run(tmp_path, reports, steps=6, accum=2, batch_size=2)
    assert [r["distributed_type"] for r in reports] == ["DistributedType.MULTI_CPU"] * 2
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6, 6]  # six train records + the final eval record


def test_deepspeed_zero2_two_ranks_on_cpu(tmp_path: Path) -> None:
    """DeepSpeed ZeRO-2 on 2 CPU processes with gloo: data split and parameters agree as for DDP."""
    pytest.importorskip("deepspeed")
    reports = _run_two_ranks(tmp_path, "deepspeed", "--max-steps", "4", "--accum", "2", "--batch-size", "2")
    _check_distributed_run(tmp_path, reports, steps=4, accum=2, batch_size=2)
    assert [r["distributed_type"] for r in reports] == ["DistributedType.DEEPSPEED"] * 2
    assert (tmp_path / "checkpoints" / "step-00000004" / "accelerate_state").is_dir()  # sharded save ran


def test_no_relaunch_for_one_process_or_inside_a_launched_child(monkeypatch) -> None:
    """One process runs in place; a child of torchrun never relaunches itself (no fork bomb)."""
    assert relaunch_command(LauncherConfig(), ["x"]) is None
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert relaunch_command(LauncherConfig(strategy="ddp", num_processes=2), ["x"]) is None


def test_launcher_entries_and_accelerate_templates_agree() -> None:
    """Every conf/launcher entry validates, and scripts/accelerate_configs/<name>.yaml is exactly
    what accelerate_config renders for it (the templates cannot drift from the launcher configs)."""
    for path in sorted((REPO / "conf" / "launcher").glob("*.yaml")):
        entry = {k: v for k, v in yaml.safe_load(path.read_text()).items() if k != "defaults"}
        launcher = LauncherConfig(**entry)
        launcher.validate()
        template = REPO / "scripts" / "accelerate_configs" / f"{path.stem}.yaml"
        assert template.is_file(), template
        assert yaml.safe_load(template.read_text()) == accelerate_config(launcher), path.stem


def test_bad_launcher_values_name_the_field() -> None:
    """Bad launcher values fail with a ValueError naming the field."""
    with pytest.raises(ValueError, match="launcher.strategy"):
        LauncherConfig(strategy="horovod").validate()
    with pytest.raises(ValueError, match="launcher.num_processes"):
        LauncherConfig(strategy="ddp", num_processes=0).validate()
    with pytest.raises(ValueError, match="strategy 'none'"):
        LauncherConfig(num_processes=2).validate()
