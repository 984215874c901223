"""min_tokens (vLLM's): a request's first ``min_tokens`` output tokens are never EOS or one of its stop tokens.

The rule lives on the target's logits: before anything reads a step's rows (the greedy argmax, the C or torch
sampler, speculative verification, logprobs), the rows that predict one of those first tokens get -inf at the
request's stop tokens. So plain decoding and every speculative path draw from the same masked distribution,
and speculative output stays distributed exactly as plain decoding's. Drafts need no mask: a stop token they
propose there has target probability 0 and is rejected.
"""

from __future__ import annotations

from collections.abc import Iterable, Set
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from draftsmith.serve_eval.engine.request import Sequence


def before_min_tokens(seq: "Sequence") -> bool:
    """Whether the sequence has emitted fewer than its min_tokens (its stop checks wait until then)."""
    return seq.num_output_tokens < seq.params.min_tokens


def mask_early_stops(logits: Tensor, rows_of: Iterable[tuple["Sequence", int, Tensor | None]],
                     eos_token_ids: Set[int]) -> None:
    """logits [R, V], in place. rows_of: (sequence, its first row, its draft nodes' depths or None) per sequence
    producing tokens this step: the first row predicts output token ``num_output_tokens``, node n's row (first
    + 1 + n) predicts output token ``num_output_tokens + depths[n]``. Rows of an output index below min_tokens
    get -inf at the sequence's stop tokens (EOS unless ignore_eos, and stop_token_ids)."""
    rows: list[int] = []
    cols: list[int] = []
    vocab = logits.shape[-1]
    for seq, first, depths in rows_of:
        left = seq.params.min_tokens - seq.num_output_tokens   # rows at depth < left are masked
        if left <= 0:
            continue
        stops = sorted({t for t in seq.params.stop_token_ids if t < vocab}
                       | (set() if seq.params.ignore_eos else {t for t in eos_token_ids if t < vocab}))
        if not stops:
            continue
        own = [first]
        if depths is not None:
            own += [first + 1 + n for n, depth in enumerate(depths.tolist()) if depth < left]
        rows += [r for r in own for _ in stops]
        cols += stops * len(own)
    if rows:
        logits[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = float("-inf")
