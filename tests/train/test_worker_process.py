"""Work in a spawned worker (train.worker_process): its OpenMP spin count, its W&B metrics relayed as they come, its
result or its error back in the parent; and the embedded target trained in one."""

from __future__ import annotations

import json
import os

import pytest
from omegaconf import OmegaConf

from draftsmith.train.worker_process import SPIN_COUNT_ENV, run_spinning


class FakeRun:
    def __init__(self) -> None:
        self.logged: list[tuple[dict, int | None]] = []

    def log(self, metrics: dict, step: int | None = None) -> None:
        self.logged.append((metrics, step))


def report_env(scale: int, run) -> tuple[str | None, int]:
    """Runs in the worker: logs two metrics, returns its spin count as it started."""
    for step in range(2):
        run.log({"loss": scale * step}, step=step)
    return os.environ.get(SPIN_COUNT_ENV), scale


def fail(kind: str, run) -> None:
    if kind == "bad-input":
        raise ValueError("target.seq_len: 9999 is longer than target.max_position 256")
    if kind == "unpicklable":
        error = RuntimeError("a lock inside")
        error.lock = __import__("threading").Lock()
        raise error
    os._exit(3)


def test_the_worker_spins_relays_its_metrics_and_returns(monkeypatch):
    monkeypatch.delenv(SPIN_COUNT_ENV, raising=False)
    run = FakeRun()
    assert run_spinning(report_env, {"scale": 5}, 1234, run, poll_s=0.05) == ("1234", 5)
    assert run.logged == [({"loss": 0}, 0), ({"loss": 5}, 1)]   # in order, with their steps
    assert SPIN_COUNT_ENV not in os.environ   # the parent's own OpenMP setting is left as it was


def test_a_spin_count_the_user_set_stands(monkeypatch):
    monkeypatch.setenv(SPIN_COUNT_ENV, "7")
    assert run_spinning(report_env, {"scale": 1}, 1234, FakeRun(), poll_s=0.05) == ("7", 1)
    assert os.environ[SPIN_COUNT_ENV] == "7"


def test_the_workers_error_is_raised_here():
    with pytest.raises(ValueError, match="target.seq_len: 9999"):   # its type kept: bad input stays one line
        run_spinning(fail, {"kind": "bad-input"}, 10, poll_s=0.05)
    with pytest.raises(RuntimeError, match="RuntimeError: a lock inside"):   # a queue cannot carry it: its text
        run_spinning(fail, {"kind": "unpicklable"}, 10, poll_s=0.05)
    with pytest.raises(RuntimeError, match=r"target training: its worker process died \(exit code 3\)"):
        run_spinning(fail, {"kind": "exit"}, 10, name="target training", poll_s=0.05)


def test_the_embedded_target_trains_in_a_spinning_worker(tmp_path):
    """target._train with omp_spin_count set and 2 threads: the worker saves a complete target, and its per-step
    losses reach the parent's W&B run."""
    from draftsmith.drafts.files import is_complete
    from draftsmith.train.config import DataConfig, TargetConfig
    from draftsmith.train.corpus import Corpus, build_embedded_records
    from draftsmith.train.target import TARGET_META_FILE, _train
    from draftsmith.train.tokenizer import train_tokenizer

    records = build_embedded_records(OmegaConf.structured(DataConfig(pool_per_domain=12, max_source_files=6)))
    corpus_dir = tmp_path / "corpus"
    corpus_dir.mkdir()
    for split in ("pretrain", "eval"):
        (corpus_dir / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    tokenizer_dir = tmp_path / "tokenizer"
    train_tokenizer([r["prompt"] + r["reference"] for r in records], vocab_size=512).save_pretrained(str(tokenizer_dir))
    tcfg = TargetConfig(vocab_size=512, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                        intermediate_size=64, max_position=128, seq_len=32, batch_size=2, max_steps=4, warmup_steps=1,
                        bf16_autocast=False, log_every=1, num_threads=2, omp_spin_count=1000,
                        eval_records_per_domain=2)
    cfg = OmegaConf.create({"target": OmegaConf.structured(tcfg), "seed": 0})
    run = FakeRun()
    _train(cfg, Corpus(corpus_dir, "hash", {}), tokenizer_dir, tmp_path / "target", run)
    assert is_complete(tmp_path / "target")
    assert json.loads((tmp_path / "target" / TARGET_META_FILE).read_text())["steps"] == 4
    assert [step for metrics, step in run.logged if "target/loss" in metrics] == [0, 1, 2, 3]


def test_a_bad_spin_count_names_the_field(tmp_path):
    from draftsmith.train.target import _train

    cfg = OmegaConf.create({"target": {"omp_spin_count": -1, "num_threads": 2}, "seed": 0})
    with pytest.raises(ValueError, match="target.omp_spin_count must be an int >= 0 or null, got -1"):
        _train(cfg, None, tmp_path, tmp_path / "target", None)
