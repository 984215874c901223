"""EAGLE-1 objective: regress the target's next feature (smooth-L1) and match its next-token distribution.

Index i pairs the target feature f_i (final-norm hidden at position i) with token x_{i+1}; the draft
predicts f_{i+1}, whose target distribution softmax(lm_head(f_{i+1})) is the soft label of x_{i+2}.
While training, the input features get uniform noise U(-w/2, w/2) (EAGLE: robustness to the draft's
own, imperfect features at later steps). Loss = feature_weight * smooth-L1 + token_weight * soft CE,
as EAGLE's v_w = 1.0, p_w = 0.1. The soft CE is computed as forward KL (same gradient, 0 at a match).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from draftsmith.drafts.eagle import EagleDraft
from draftsmith.train import losses
from draftsmith.train.distill.objective import PositionCounts
from draftsmith.train.distill.objectives.common import (
    FeatureSource,
    ahead_mask,
    chain_counts,
    shift_left,
    uniform_noise,
)
from draftsmith.train.distill.objectives.registry import register_objective
from draftsmith.train.distill.objectives.teacher import Teacher


class EagleModule(nn.Module):
    def __init__(self, draft: nn.Module) -> None:
        super().__init__()
        self.draft = draft

    def forward(self, input_ids: Tensor, features: Tensor, num_steps: int) -> list[tuple[Tensor, Tensor]]:
        """input_ids [B,S] (x_{i+1}), features [B,S,*] (target side at i) -> (hidden, logits) per unrolled step."""
        return self.draft.ttt_forward(input_ids, features, num_steps)


def eagle_inputs(input_ids: Tensor, features: Tensor) -> tuple[Tensor, Tensor]:
    """Pair feature i with token i+1: ids [B, S-1], features [B, S-1, *]."""
    return input_ids[:, 1:], features[:, :-1]


def unrolled_counts(outs: list[tuple[Tensor, Tensor]], input_ids: Tensor, loss_mask: Tensor, to_target_ids=None) -> PositionCounts:
    """Step j at index i predicts x_{i+2+j}: top-1 (mapped to target ids) against the data token."""
    width = outs[0][1].shape[1]
    hits, valid = [], []
    for j, (_, logits) in enumerate(outs):
        predicted = logits.argmax(-1)
        if to_target_ids is not None:
            predicted = to_target_ids(predicted)
        hits.append(predicted == shift_left(input_ids, 2 + j, width))
        valid.append(ahead_mask(loss_mask, 2 + j, width))
    return chain_counts(hits, valid)


class EagleObjective:
    def __init__(self, cfg, teacher: Teacher | None) -> None:
        self.cfg = cfg
        self.features = FeatureSource(cfg.mode, teacher)

    def build(self, models: Mapping, device: torch.device) -> nn.Module:
        self.features.to(device)
        draft: EagleDraft = models["draft"]
        return EagleModule(draft).to(device)

    def loss(self, model: nn.Module, batch: Mapping[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        hidden, _, teacher_logits = self.features.get(batch, need_logits=True)
        ids_in, feats_in = eagle_inputs(batch["input_ids"], hidden)
        if model.training:
            feats_in = uniform_noise(feats_in, self.cfg.noise_width)
        (predicted, logits), = model(ids_in, feats_in, 1)
        width = ids_in.shape[1]
        mask = ahead_mask(batch["loss_mask"], 2, width)
        feature_loss = losses.feature_smooth_l1(predicted, hidden[:, 1:], mask=mask)
        if teacher_logits is None:  # offline: the target's distribution from its cached feature
            with torch.no_grad():
                teacher_logits = torch.nn.functional.linear(hidden[:, 1:], self._lm_head(model).float())
        else:
            teacher_logits = teacher_logits[:, 1:]
        token_loss = losses.forward_kl(logits.float(), teacher_logits, mask=mask)
        loss = self.cfg.feature_weight * feature_loss + self.cfg.token_weight * token_loss
        return loss, {"feature_smooth_l1": feature_loss.detach(), "token_kl": token_loss.detach()}

    @staticmethod
    def _lm_head(model: nn.Module) -> Tensor:
        return getattr(model, "module", model).draft.lm_head.weight.detach()  # the target's, frozen

    @torch.no_grad()
    def eval_metrics(self, model: nn.Module, batch: Mapping[str, Tensor]) -> PositionCounts:
        hidden, _, _ = self.features.get(batch, need_logits=False)
        ids_in, feats_in = eagle_inputs(batch["input_ids"], hidden)
        outs = model(ids_in, feats_in, self.cfg.eval_steps)
        return unrolled_counts(outs, batch["input_ids"], batch["loss_mask"])


@register_objective("eagle")
def build_eagle_objective(dcfg, teacher, target_dir, draft) -> EagleObjective:
    return EagleObjective(dcfg, teacher)
