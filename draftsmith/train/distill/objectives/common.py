"""Pieces every draft objective shares: target alignment masks, chain accuracy counts, feature sources.

Alignment, in one place. ``loss_mask[b, t]`` (train.distill.data) marks token t as a prediction target.
* A next-token predictor at position p is scored when token p+1 is a target: ``next_token_mask``.
* EAGLE index i pairs feature f_i with token x_{i+1}; after j unrolled steps its logits predict x_{i+2+j}:
  ``ahead_mask(loss_mask, 2 + j, width)``; Medusa head k at position t predicts x_{t+k+2}: the same helper.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from draftsmith.train.distill.objective import PositionCounts
from draftsmith.train.distill.objectives.teacher import Teacher


def unwrap(model: nn.Module) -> nn.Module:
    """The module under a DDP wrapper (for no-grad side work such as on-policy generation)."""
    return getattr(model, "module", model)


def shift_left(x: Tensor, shift: int, width: int, fill: Any = 0) -> Tensor:
    """x [B, S, ...] -> [B, width, ...] with out[:, i] = x[:, i + shift] (``fill`` past the end)."""
    out = torch.full((x.shape[0], width, *x.shape[2:]), fill, dtype=x.dtype, device=x.device)
    available = max(0, min(width, x.shape[1] - shift))
    if available:
        out[:, :available] = x[:, shift : shift + available]
    return out


def ahead_mask(loss_mask: Tensor, shift: int, width: int) -> Tensor:
    """bool [B, width]: out[:, i] = loss_mask[:, i + shift] (False past the end)."""
    return shift_left(loss_mask.bool(), shift, width, False)


def next_token_mask(loss_mask: Tensor) -> Tensor:
    return ahead_mask(loss_mask, 1, loss_mask.shape[1])


def chain_counts(hits: list[Tensor], valid: list[Tensor]) -> PositionCounts:
    """Per-position counts from per-depth hit/valid masks (each bool, any shape)."""
    correct = torch.stack([(h & v).sum() for h, v in zip(hits, valid)]).double()
    total = torch.stack([v.sum() for v in valid]).double()
    return PositionCounts(correct.cpu(), total.cpu())


def uniform_noise(x: Tensor, width: float) -> Tensor:
    """EAGLE's input-feature noise U(-width/2, width/2), drawn from the global torch RNG (restored on resume)."""
    return x + (torch.rand_like(x) - 0.5) * width if width > 0 else x


class FeatureSource:
    """Target features for a batch: cached (offline) fields, or a teacher forward (online)."""

    def __init__(self, mode: str, teacher: Teacher | None, aux_layers: list[int] | None = None) -> None:
        if mode not in ("online", "offline"):
            raise ValueError(f"draft.mode: {mode!r} is not one of ('online', 'offline')")
        if mode == "online" and teacher is None:
            raise ValueError("draft.mode=online needs the target model (teacher) inside the loop")
        self.mode, self.teacher, self.aux_layers = mode, teacher, list(aux_layers or [])

    def to(self, device: torch.device) -> None:
        if self.teacher is not None:
            self.teacher.to(device)

    def get(self, batch: Mapping[str, Tensor], need_logits: bool) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """(final hidden [B,S,d] fp32 | None, aux [B,S,3d] | None, teacher logits [B,S,V] | None)."""
        if self.mode == "offline":
            for name in (["aux_hidden"] if self.aux_layers else []) + ["hidden"]:
                if name not in batch:
                    raise ValueError(f"offline mode: batch has no field '{name}' (fields: {sorted(batch)}); "
                                     "generate the data with the draft's offline settings")
            aux = batch["aux_hidden"].float() if self.aux_layers else None
            return batch["hidden"].float(), aux, None
        out = self.teacher(batch["input_ids"], batch["attention_mask"], self.aux_layers, need_logits=need_logits)
        aux = out.aux_hidden.float() if out.aux_hidden is not None else None
        return out.hidden.float(), aux, out.logits
