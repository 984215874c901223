"""EAGLE-3 proposer: the EAGLE machinery (serve_eval.speculative.proposers.eagle) with EAGLE-3's inputs and head.

Step 0 fuses the target's three aux layers (TargetFeatures.aux [n, 3 * d_t], HF hidden_states indexing,
default [2, L//2, L-3]; the layers come from the draft's own config, i.e. what it was trained on); later
steps feed the draft's pre-norm output back. Logits come from the draft's norm + LM head over its
(possibly reduced) vocabulary, scattered into the target vocabulary with -inf outside it, so
logits_to_probs gives those tokens probability 0.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from draftsmith.serve_eval.speculative.proposers.eagle import EagleProposer
from draftsmith.serve_eval.speculative.proposers.registry import register_proposer


@register_proposer("eagle3")
class Eagle3Proposer(EagleProposer):
    kind = "eagle3"
    feature_name = "aux"

    def _setup(self, draft: torch.nn.Module, **opts: Any) -> None:
        super()._setup(draft, **opts)
        self.aux_layers = tuple(draft.config.aux_layers)

    @property
    def feature_width(self) -> int:
        return 3 * self.draft.config.target_hidden_size

    def _ingest_input(self, rows: Tensor) -> Tensor:  # aux [n, 3 d_t] -> fused [n, d]
        return self.draft.fuse(rows)

    def _logits(self, hidden_out: Tensor) -> Tensor:  # -> target-vocab logits [n, V], -inf outside the draft vocab
        return self.draft.to_target_logits(self.draft.compute_logits(hidden_out).float())

    def _target_rows(self, draft_probs: Tensor) -> Tensor:  # draft-vocab probabilities -> target vocab, 0 outside
        return self.draft.to_target_vocab(draft_probs, 0.0)
