"""Hydra configuration and the draftsmith CLI: type checks at start, job dispatch, multirun, smoke pipeline."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from draftsmith.train import cli
from draftsmith.train.config import OPEN_GROUPS, check_open_groups, compose

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "DRAFTSMITH_NO_PROGRESS": "1", "HYDRA_FULL_ERROR": "0"}
    return subprocess.run([sys.executable, "-m", "draftsmith.train.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_default_config_composes_with_every_group():
    """The default config has all groups, typed, with the embedded target and W&B offline."""
    cfg = compose()
    for group in ("target", "data", "pipeline", *OPEN_GROUPS):
        assert group in cfg
    assert cfg.target.num_layers >= 8 and cfg.wandb.mode == "offline"
    assert list(cfg.pipeline.stages)[:4] == ["corpus", "tokenizer", "target", "generate"]
    assert list(cfg.pipeline.stages)[-3:] == ["eval", "report", "register"]


def test_smoke_profile_overrides_target_and_data():
    """pipeline=smoke swaps in the tiny target and small corpus; CLI overrides still win."""
    cfg = compose(["pipeline=smoke", "target.max_steps=7"])
    assert cfg.target.name == "tiny" and cfg.data.name == "smoke" and cfg.target.max_steps == 7


@pytest.mark.parametrize("override, needle", [
    ("target.no_such_key=1", "no_such_key"),
    ("no_such_root_key=1", "no_such_root_key"),
    ("target.num_layers=eight", "num_layers"),
    ("data.eval_per_domain=1.5", "eval_per_domain"),
    ("draft.not_a_draft_field=3", "not_a_draft_field"),
])
def test_unknown_key_or_wrong_type_fails_at_compose(override, needle):
    """Unknown keys and wrong types are rejected while composing (Hydra's error names the key)."""
    with pytest.raises(Exception, match=needle):
        compose([override])


def test_cli_rejects_bad_override_before_any_stage():
    """`draftsmith pipeline` with an unknown key exits non-zero with Hydra's message and runs no stage."""
    proc = run_cli("pipeline", "target.hidden=7", "artifacts_root=/nonexistent/never-created")
    assert proc.returncode != 0
    assert "Key 'hidden' not in 'TargetConfig'" in proc.stderr and "stage=" not in proc.stdout + proc.stderr


def test_missing_configs_say_where_they_were_looked_for_and_how_to_point_at_them(tmp_path):
    """An installed copy without the checkout's conf/: one line naming the folder and DRAFTSMITH_CONF."""
    env = {**os.environ, "DRAFTSMITH_CONF": str(tmp_path / "no-conf")}
    proc = subprocess.run([sys.executable, "-m", "draftsmith.train.cli", "pipeline"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0
    assert f"no config.yaml in {tmp_path / 'no-conf'}" in proc.stderr and "DRAFTSMITH_CONF" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_open_group_entry_without_schema_is_refused():
    """An entry in an open group that selected no schema (untyped dict) is refused, naming the group."""
    cfg = compose()
    cfg = OmegaConf.merge(OmegaConf.to_container(cfg), {})  # drop all typing
    with pytest.raises(ValueError, match="config group 'draft'"):
        check_open_groups(cfg)


def test_help_lists_jobs(capsys):
    """`draftsmith --help` lists every registered job."""
    cli.main(["--help"])
    out = capsys.readouterr().out
    for job in ("pipeline", "distill", "generate", "eval", "serve", "plan", "export", "hook", "drafts"):
        assert f"  {job}" in out


def test_missing_job_module_says_not_available(monkeypatch):
    """A job whose module is not installed stops with one line naming the job and the module."""
    monkeypatch.setitem(cli.JOBS, "ghost", ("train.no_such_job_module:main", "test"))
    with pytest.raises(SystemExit, match="draftsmith ghost train.no_such_job_module:main: module "
                                         "train.no_such_job_module is not installed"):
        cli.main(["ghost"])
    with pytest.raises(SystemExit, match="unknown job"):
        cli.main(["nonsense"])


def test_python_m_entry_and_cfg_print():
    """`python -m draftsmith.train.pipeline --cfg job` composes and prints the config without running stages."""
    env = {**os.environ, "DRAFTSMITH_NO_PROGRESS": "1"}
    proc = subprocess.run([sys.executable, "-m", "draftsmith.train.pipeline", "--cfg", "job", "pipeline=smoke"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "name: tiny" in proc.stdout and "stage=" not in proc.stdout


def test_multirun_sweeps_seeds(tmp_path):
    """`-m seed=0,1` runs the (corpus-only) pipeline twice, giving two differently split corpora."""
    proc = run_cli("pipeline", "-m", "pipeline=smoke", "pipeline.stages=[corpus]", "seed=0,1",
                   f"artifacts_root={tmp_path}", "wandb.mode=disabled")
    assert proc.returncode == 0, proc.stderr[-2000:]
    corpora = [p for p in (tmp_path / "corpus").iterdir() if not p.name.startswith(".")]
    assert len(corpora) == 2


def test_smoke_pipeline_end_to_end_and_cached_rerun(tmp_path):
    """The smoke pipeline trains a tiny target, prints per-domain perplexity and its dir; a rerun reuses it."""
    # The foundation stages only; the whole chain is tests/test_pipeline_smoke.py.
    stages = "pipeline.stages=[corpus,tokenizer,target]"
    proc = run_cli("pipeline", "pipeline=smoke", stages, f"artifacts_root={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "held-out perplexity per domain" in out
    for domain in ("code", "prose", "math", "chat"):
        assert f"  {domain} " in out
    model_dir = Path(out.split("target saved at: ")[1].splitlines()[0])
    for name in ("config.json", "model.safetensors", "tokenizer.json", "perplexity.json"):
        assert (model_dir / name).is_file(), name
    assert "cached=False" in out
    fingerprint = out.split("target fingerprint: ")[1].split()[0]
    assert (tmp_path / "targets" / fingerprint / "drafts").is_dir()
    assert (tmp_path / "wandb").is_dir()  # W&B ran offline under the artifacts root
    logs = proc.stdout + proc.stderr  # Hydra's job logging writes to stdout
    for name in ("corpus", "tokenizer", "target"):
        assert f"stage={name} status=done" in logs
    assert "wall_s=" in logs

    again = run_cli("pipeline", "pipeline=smoke", stages, f"artifacts_root={tmp_path}", "wandb.mode=disabled")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "cached=True" in again.stdout and str(model_dir) in again.stdout
