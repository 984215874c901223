"""anneal_to_time_cap: the LR schedule's progress is also elapsed / max_minutes (whichever is further), so a time cap
that binds ends an annealed schedule instead of cutting a cosine near its peak; the rule the target's training uses."""
from __future__ import annotations

import json

import pytest
import torch
from distill_toy import ToyDraft, ToyObjective, toy_dataset
from hypothesis import given, settings
from hypothesis import strategies as st

from draftsmith.train.distill.launch import LauncherConfig
from draftsmith.train.distill.trainer import Trainer
from draftsmith.train.distill.trainer_config import TrainerConfig, lr_factor


@settings(max_examples=200, deadline=None)
@given(step=st.integers(0, 5000), warmup=st.integers(0, 50), max_steps=st.integers(1, 5000),
       time_frac=st.floats(0.0, 3.0), later=st.floats(0.0, 1.0))
def test_time_only_moves_the_schedule_forward(step, warmup, max_steps, time_frac, later):
    """Past warmup, the factor with a time fraction is the step schedule's or lower, never above 1 or below the
    floor, and falls as the time fraction grows; at or past the cap it is the floor."""
    steps_only = lr_factor(step, warmup, max_steps, "cosine", 0.1)
    timed = lr_factor(step, warmup, max_steps, "cosine", 0.1, time_frac)
    if step < warmup:
        assert timed == steps_only
        return
    assert 0.1 - 1e-12 <= timed <= steps_only + 1e-12
    assert lr_factor(step, warmup, max_steps, "cosine", 0.1, time_frac + later) <= timed + 1e-12
    assert lr_factor(step, warmup, max_steps, "cosine", 0.1, max(1.0, time_frac)) == pytest.approx(0.1)


class _Clock:
    """Half a second per reading: the trainer reads it once at the start and once per step."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 0.5
        return self.now


@pytest.mark.parametrize("anneal", [True, False])
def test_a_binding_cap_ends_an_annealed_schedule(tmp_path, anneal):
    """A 12 s cap at 0.5 s a step and max_steps 1000: the cap ends training near step 23 either way; annealing to
    it, the LR has decayed monotonically to its floor by then; without, the cap cut the cosine near its peak."""
    config = TrainerConfig(output_dir=str(tmp_path), max_steps=1000, max_minutes=0.2, anneal_to_time_cap=anneal,
                           batch_size=4, lr=3e-2, warmup_steps=2, min_lr_ratio=0.1, eval_batch_size=4)
    torch.manual_seed(0)
    trainer = Trainer(config, ToyObjective(), {"draft": ToyDraft()}, toy_dataset(24, seed=1), toy_dataset(8, seed=2),
                      launcher=LauncherConfig(name="none", strategy="none", num_processes=1), run_config={"toy": True})
    trainer.clock = _Clock()
    with trainer:
        result = trainer.fit()
    lrs = [r["lr"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if "lr" in r]
    assert result.stopped_by_time_cap and 20 <= result.state.step <= 25 and len(lrs) == result.state.step
    assert result.final_metrics and result.annealed_to_time_cap == anneal
    if anneal:
        assert lrs[-1] == pytest.approx(3e-2 * 0.1, rel=0.1)
        assert all(a >= b for a, b in zip(lrs[2:], lrs[3:]))   # after warmup: monotone decay
    else:
        assert lrs[-1] > 0.9 * 3e-2


@pytest.mark.parametrize("minutes", [0, -1.5])
def test_a_cap_of_no_time_is_refused_by_name(minutes):
    """train.max_minutes 0 (or below) is refused with one line naming the field, before any step (it divided by
    zero at the first step's time check)."""
    with pytest.raises(ValueError, match=r"train.max_minutes must be > 0 \(or null: no cap\), got"):
        TrainerConfig(max_minutes=minutes).validate()
    TrainerConfig(max_minutes=None).validate()
