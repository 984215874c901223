"""Prompt-lookup n-gram proposer: no model, drafts copied from the sequence's own history.

For n from max_n down to min_n, the last n tokens are searched for earlier in the sequence (prompt
and output). The first n that matches wins; among its matches, the most recent one followed by K
full tokens is used (recent context is the better guess), else the earliest match (the longest
continuation available). The tokens after the match are the draft: point masses (draft_probs None),
which rejection sampling handles exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from draftsmith.serve_eval.speculative.proposers.base import (
    Proposal,
    Proposer,
    SequenceView,
    check_num_tokens,
)
from draftsmith.serve_eval.speculative.proposers.registry import register_proposer


def lookup_continuation(
    tokens: np.ndarray, k: int, max_n: int, min_n: int, max_lookback: int | None = None
) -> np.ndarray:
    """Up to k tokens that followed an earlier occurrence of the longest matching suffix n-gram."""
    if max_lookback is not None and tokens.size > max_lookback:
        tokens = tokens[-max_lookback:]
    length = tokens.size
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = tokens[length - n :]
        # Windows start at 0..length-1-n, so each match has at least one following token
        # and the suffix does not match itself.
        windows = sliding_window_view(tokens[: length - 1], n)
        starts = np.flatnonzero((windows == pattern).all(axis=1))
        if starts.size == 0:
            continue
        full = starts[starts + n + k <= length]
        start = int(full[-1]) if full.size else int(starts[0])
        return tokens[start + n : start + n + k]
    return tokens[:0]


@register_proposer("ngram")
class NgramProposer(Proposer):
    def __init__(self, max_n: int = 3, min_n: int = 1, max_lookback: int | None = None) -> None:
        if min_n <= 0 or max_n < min_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got min_n {min_n}, max_n {max_n}")
        if max_lookback is not None and max_lookback <= max_n:
            raise ValueError(f"max_lookback ({max_lookback}) must exceed max_n ({max_n})")
        self.max_n, self.min_n, self.max_lookback = max_n, min_n, max_lookback

    @classmethod
    def from_spec_config(cls, config, engine=None) -> "NgramProposer":
        return cls(config.ngram_max_n, config.ngram_min_n, config.ngram_max_lookback)

    def propose(
        self,
        seqs: Sequence[SequenceView],
        num_tokens: Sequence[int],
        features: Sequence[object] | None = None,
    ) -> list[Proposal]:
        check_num_tokens(num_tokens, len(seqs))
        proposals = []
        for seq, k in zip(seqs, num_tokens):
            history = np.asarray(seq.token_ids, dtype=np.int64)
            draft = lookup_continuation(history, k, self.max_n, self.min_n, self.max_lookback)
            proposals.append(Proposal(torch.from_numpy(draft.copy())))
        return proposals
