"""draftsmith.kernels.row_ops: the fast row reductions return exactly what torch's do."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from draftsmith.kernels.row_ops import argmax_rows, topk_rows


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 20), st.sampled_from([64, 4096, 4099, 8192]), st.integers(0, 2**31 - 1), st.booleans())
def test_blocked_argmax_is_torch_argmax(rows, vocab, seed, ties):
    """argmax_rows equals torch.argmax exactly, first index on ties included (ties across blocks too)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen)
    if ties:  # the maximum at several places, in different blocks
        logits = logits.round()
        top = logits.amax(dim=-1, keepdim=True)
        logits[:, torch.randint(0, vocab, (5,), generator=gen)] = top
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([1, 5, 66, 200]), st.sampled_from([4, 40, 100_000]))
def test_topk_rows_has_torch_topk_values_at_ids_holding_them(seed, width, num_values):
    """The group prefilter returns torch.topk's values (descending), at distinct ids that hold them; few distinct
    values put ties across groups and at the window's edge."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, num_values, (5, 4096), generator=gen).float()
    scores[0, :] = float("-inf")
    scores[0, 4095] = 1.0   # a row that is all -inf but one entry
    values, ids = topk_rows(scores, width)
    assert torch.equal(values, scores.topk(width, dim=-1).values)
    assert torch.equal(scores.gather(-1, ids), values)
    assert all(len(set(row)) == width for row in ids.tolist())


def test_topk_rows_takes_an_empty_batch():
    values, ids = topk_rows(torch.zeros(0, 4096), 20)
    assert values.shape == ids.shape == (0, 20)
