"""Batches for the distill trainer: collation with loss masks and a resumable, rank-sharded sampler.

Loss-mask convention (every objective relies on it): ``loss_mask[b, t] == True`` means token ``t`` of
row ``b`` is a prediction target (predicted from tokens ``< t``). Prompt tokens and padding are False.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor


def _as_1d_list(value: Any, field: str, row: int) -> list:
    if isinstance(value, Tensor):
        return value.reshape(-1).tolist()
    if isinstance(value, (list, tuple)):
        return list(value)
    raise ValueError(f"example {row}: field '{field}' must be a list or 1-d tensor, got {type(value).__name__}")


def _loss_mask_for(example: Mapping[str, Any], length: int, row: int) -> list[bool]:
    """Explicit `loss_mask`, else everything after `prompt_length` (the answer), else every token but the first."""
    if "loss_mask" in example:
        mask = [bool(m) for m in _as_1d_list(example["loss_mask"], "loss_mask", row)]
        if len(mask) != length:
            raise ValueError(f"example {row}: field 'loss_mask' has {len(mask)} entries, 'input_ids' has {length}")
        return mask
    if "prompt_length" in example:
        prompt_length = int(example["prompt_length"])
        if not 0 <= prompt_length <= length:
            raise ValueError(f"example {row}: field 'prompt_length'={prompt_length} outside [0, {length}]")
        return [t >= max(prompt_length, 1) for t in range(length)]
    return [t >= 1 for t in range(length)]


def _pad_aligned(values: list[Tensor], total_length: int) -> Tensor:
    """Stack per-example tensors whose dim 0 runs along the sequence, right-padding dim 0 with zeros."""
    out = values[0].new_zeros((len(values), total_length, *values[0].shape[1:]))
    for row, value in enumerate(values):
        out[row, : value.shape[0]] = value
    return out


def _token_rows(examples: Sequence[Mapping[str, Any]], max_length: int | None) -> tuple[list[list[int]], list[list[bool]]]:
    """Each example's token ids and loss mask, checked and cut to ``max_length``."""
    token_lists, mask_lists = [], []
    for row, example in enumerate(examples):
        if "input_ids" not in example:
            raise ValueError(f"example {row}: missing field 'input_ids' (fields: {sorted(example)})")
        ids = [int(t) for t in _as_1d_list(example["input_ids"], "input_ids", row)]
        if not ids:
            raise ValueError(f"example {row}: field 'input_ids' is empty")
        mask = _loss_mask_for(example, len(ids), row)
        if max_length is not None:
            ids, mask = ids[:max_length], mask[:max_length]
        token_lists.append(ids)
        mask_lists.append(mask)
    return token_lists, mask_lists


def _padded_tokens(token_lists: list[list[int]], mask_lists: list[list[bool]], pad_token_id: int,
                   total_length: int) -> dict[str, Tensor]:
    """input_ids, attention_mask, loss_mask and position_ids, right-padded to ``total_length``."""
    batch_size = len(token_lists)
    input_ids = torch.full((batch_size, total_length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((batch_size, total_length), dtype=torch.bool)
    loss_mask = torch.zeros((batch_size, total_length), dtype=torch.bool)
    for row, (ids, mask) in enumerate(zip(token_lists, mask_lists)):
        input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, : len(ids)] = True
        loss_mask[row, : len(ids)] = torch.tensor(mask, dtype=torch.bool)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "position_ids": torch.arange(total_length).expand(batch_size, -1).clone(),
    }


def _extra_field(examples: Sequence[Mapping[str, Any]], field: str, token_lists: list[list[int]],
                 total_length: int) -> Tensor:
    """One non-token field of the batch: scalars stacked, per-position tensors aligned with the tokens."""
    values = [example.get(field) for example in examples]
    if any(v is None for v in values):
        raise ValueError(f"field '{field}' is present in some examples of the batch but not all")
    tensors = [v if isinstance(v, Tensor) else torch.as_tensor(v) for v in values]
    if tensors[0].dim() == 0:
        return torch.stack(tensors)
    for row, (tensor, ids) in enumerate(zip(tensors, token_lists)):
        if tensor.shape[0] < len(ids):
            raise ValueError(
                f"example {row}: field '{field}' has {tensor.shape[0]} rows along the sequence, "
                f"'input_ids' has {len(ids)}"
            )
    return _pad_aligned([t[: len(ids)] for t, ids in zip(tensors, token_lists)], total_length)


def collate_token_sequences(
    examples: Sequence[Mapping[str, Any]],
    pad_token_id: int,
    max_length: int | None = None,
    pad_to_multiple_of: int | None = None,
) -> dict[str, Tensor]:
    """Right-pad token sequences into a batch.

    Each example needs ``input_ids``; optional ``loss_mask`` or ``prompt_length`` (see module docstring).
    Any other tensor field whose dim 0 equals the example's length (cached hidden states [T, d],
    top-k logits [T, k]) is truncated/padded along the sequence like the tokens; scalar fields are stacked.
    Returns input_ids int64 [B, T], attention_mask bool [B, T], loss_mask bool [B, T], position_ids int64 [B, T].
    """
    if not examples:
        raise ValueError("collate_token_sequences: empty batch")
    token_lists, mask_lists = _token_rows(examples, max_length)
    total_length = max(len(ids) for ids in token_lists)
    if pad_to_multiple_of:
        total_length = -(-total_length // pad_to_multiple_of) * pad_to_multiple_of
    batch = _padded_tokens(token_lists, mask_lists, pad_token_id, total_length)
    for field in examples[0]:
        if field not in ("input_ids", "loss_mask", "prompt_length"):
            batch[field] = _extra_field(examples, field, token_lists, total_length)
    return batch


class ShardedResumableSampler:
    """Batch sampler: a seeded permutation per epoch, split into global batches of
    ``world_size * batch_size`` indices, of which rank ``r`` takes slice ``r``.

    Shards are disjoint and every rank sees the same number of batches (the tail that does not fill a
    global batch is dropped), so collective ops in DDP/FSDP/DeepSpeed never wait on a rank that ran dry.
    The order depends only on (seed, epoch), so ``set_position(epoch, batches_consumed)`` resumes exactly.
    """

    def __init__(
        self,
        num_examples: int,
        batch_size: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        if num_examples < batch_size * world_size:
            raise ValueError(
                f"dataset has {num_examples} examples, fewer than one global batch "
                f"(batch_size {batch_size} x world_size {world_size})"
            )
        self.num_examples = num_examples
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.start_batch = 0

    @property
    def batches_per_epoch(self) -> int:
        return self.num_examples // (self.batch_size * self.world_size)

    def __len__(self) -> int:
        return self.batches_per_epoch - self.start_batch

    def set_position(self, epoch: int, batches_consumed: int) -> None:
        """The next iteration yields batch ``batches_consumed`` of ``epoch`` onwards."""
        if not 0 <= batches_consumed <= self.batches_per_epoch:
            raise ValueError(
                f"batches_consumed={batches_consumed} outside [0, {self.batches_per_epoch}] for this dataset"
            )
        self.epoch, self.start_batch = epoch, batches_consumed

    def epoch_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_examples))
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_examples, generator=generator).tolist()

    def batch_indices(self, epoch: int, batch_index: int, order: list[int] | None = None) -> list[int]:
        """This rank's examples in batch ``batch_index`` of ``epoch`` (``order``: that epoch's, if at hand)."""
        order = self.epoch_order(epoch) if order is None else order
        offset = batch_index * self.batch_size * self.world_size + self.rank * self.batch_size
        return order[offset : offset + self.batch_size]

    def examples_of(self, batches: Sequence[tuple[int, int]]) -> list[int]:
        """This rank's examples in the given (epoch, batch index) batches, in that order."""
        orders: dict[int, list[int]] = {}
        examples: list[int] = []
        for epoch, batch_index in batches:
            if epoch not in orders:
                orders[epoch] = self.epoch_order(epoch)
            examples += self.batch_indices(epoch, batch_index, orders[epoch])
        return examples

    def __iter__(self) -> Iterator[list[int]]:
        order = self.epoch_order(self.epoch)
        for batch_index in range(self.start_batch, self.batches_per_epoch):
            yield self.batch_indices(self.epoch, batch_index, order)


def eval_shard_batches(num_examples: int, batch_size: int, rank: int, world_size: int) -> list[list[int]]:
    """Held-out batches of this rank: indices ``rank::world_size`` in order, nothing dropped.
    Ranks may get one batch fewer; the trainer pads with a discarded repeat to keep collectives aligned."""
    own = list(range(rank, num_examples, world_size))
    return [own[i : i + batch_size] for i in range(0, len(own), batch_size)]
