"""Collation, the resumable sharded sampler, the LR schedule and simulated tau of the distill trainer."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from draftsmith.serve_eval.speculative.metrics import simulated_tau
from draftsmith.train.distill.data import ShardedResumableSampler, collate_token_sequences, eval_shard_batches
from draftsmith.train.distill.trainer_config import lr_factor


def test_collate_pads_and_masks() -> None:
    """Right padding with pad id, attention mask over real tokens, loss mask from prompt_length,
    explicit loss_mask respected, sequence-aligned extra fields padded with zeros."""
    batch = collate_token_sequences(
        [
            {"input_ids": [5, 6, 7, 8], "prompt_length": 2, "hidden": torch.ones(4, 3)},
            {"input_ids": [9, 10], "loss_mask": [0, 1], "hidden": torch.ones(2, 3)},
        ],
        pad_token_id=0,
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8], [9, 10, 0, 0]]
    assert batch["attention_mask"].tolist() == [[True] * 4, [True, True, False, False]]
    assert batch["loss_mask"].tolist() == [[False, False, True, True], [False, True, False, False]]
    assert batch["hidden"].shape == (2, 4, 3) and batch["hidden"][1, 2:].abs().sum() == 0


def test_collate_bad_input_names_the_field() -> None:
    """Missing input_ids and mismatched loss_mask give ValueErrors naming the field."""
    with pytest.raises(ValueError, match="'input_ids'"):
        collate_token_sequences([{"tokens": [1]}], pad_token_id=0)
    with pytest.raises(ValueError, match="'loss_mask'"):
        collate_token_sequences([{"input_ids": [1, 2], "loss_mask": [1]}], pad_token_id=0)


@settings(max_examples=40, deadline=None)
@given(st.integers(8, 60), st.integers(1, 4), st.integers(1, 4), st.integers(0, 3), st.integers(0, 5))
def test_sampler_shards_are_disjoint_equal_and_resumable(n, batch_size, world_size, epoch, cut) -> None:
    """Per epoch the ranks' batches are disjoint, equally many, and cover every full global batch;
    resuming at any position yields exactly the remaining batches."""
    if n < batch_size * world_size:
        return
    samplers = [ShardedResumableSampler(n, batch_size, rank=r, world_size=world_size, seed=3) for r in range(world_size)]
    for s in samplers:
        s.set_position(epoch, 0)
    shards = [[i for b in s for i in b] for s in samplers]
    flat = [i for shard in shards for i in shard]
    assert len(flat) == len(set(flat)) == samplers[0].batches_per_epoch * batch_size * world_size
    assert len({len(shard) for shard in shards}) == 1
    full = list(samplers[0])
    start = min(cut, len(full))
    samplers[0].set_position(epoch, start)
    assert list(samplers[0]) == full[start:]


def test_eval_shards_cover_everything_once() -> None:
    """Held-out sharding drops nothing and repeats nothing."""
    got = sorted(i for r in range(3) for b in eval_shard_batches(10, 2, r, 3) for i in b)
    assert got == list(range(10))


def test_simulated_tau_hand_values() -> None:
    """tau = 1 + a1 + a1*a2 + ...: hand values; all-accept gives K+1, none gives 1."""
    assert simulated_tau([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    assert simulated_tau([1.0, 1.0, 1.0]) == 4.0
    assert simulated_tau([0.0, 1.0]) == 1.0
    with pytest.raises(ValueError):
        simulated_tau([1.5])


def test_lr_schedule_warmup_then_decay() -> None:
    """Linear warmup reaches 1 at the last warmup step; cosine/linear end at min_lr_ratio."""
    assert [lr_factor(s, 4, 10, "cosine", 0.1) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(10, 4, 10, "cosine", 0.1) == pytest.approx(0.1)
    assert lr_factor(7, 4, 10, "linear", 0.0) == pytest.approx(0.5)
    assert lr_factor(9, 0, 10, "constant", 0.0) == 1.0


class _Answers:
    """A dataset's per-example answer temperatures (what trained_answers reads)."""

    cache_dir = "cache/data"

    def __init__(self, temperatures: list[float]) -> None:
        self.temperatures = temperatures

    def __len__(self) -> int:
        return len(self.temperatures)

    def answer_temperatures(self) -> list[float]:
        return self.temperatures


def test_trained_answers_keeps_the_named_temperatures_only() -> None:
    from draftsmith.train.distill.run import trained_answers

    answers = _Answers([0.0, 1.0, 0.0, 0.7, 1.0])
    assert trained_answers(answers, None) == [0, 1, 2, 3, 4]
    assert trained_answers(answers, [0.0]) == [0, 2]
    assert trained_answers(answers, [1.0, 0.7]) == [1, 3, 4]
    with pytest.raises(ValueError, match=r"draft.train_temperatures: \[0.5\] matches no answer in cache/data: its "
                                         r"answers were generated at \[0.0, 0.7, 1.0\]"):
        trained_answers(answers, [0.5])
