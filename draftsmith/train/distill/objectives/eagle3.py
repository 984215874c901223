"""EAGLE-3 objective: fused low/mid/high target features and "training-time test".

The draft is unrolled ``ttt_steps`` times on its own hidden states (drafts.common.unroll_ttt); step j at
index i predicts x_{i+2+j} and weighs ``step_weight_decay ** j``. Labels are the target's distribution
restricted to the draft vocabulary (soft, as EAGLE-3 trains; ``label_temperature`` below 1 sharpens them toward
the argmax for a draft served at T=0), and a position counts only where the
target's top token is in the draft vocabulary. The target's distribution comes from the online forward,
or offline from the cached final-norm hidden through the target's lm_head (kept here, frozen).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.drafts.eagle3 import Eagle3Draft
from draftsmith.train import losses
from draftsmith.train.distill.objective import PositionCounts
from draftsmith.train.distill.objectives.common import FeatureSource, ahead_mask, uniform_noise
from draftsmith.train.distill.objectives.eagle import EagleModule, eagle_inputs, unrolled_counts
from draftsmith.train.distill.objectives.registry import register_objective
from draftsmith.train.distill.objectives.teacher import Teacher


class Eagle3Objective:
    def __init__(self, cfg, teacher: Teacher | None, target_lm_head: Tensor, aux_layers: list[int]) -> None:
        self.cfg = cfg   # checked by train.recipes.check_recipe, which every job runs before building this
        self.features = FeatureSource(cfg.mode, teacher, aux_layers)
        self.target_lm_head = target_lm_head  # [V, d_target], frozen
        self.weights = [cfg.step_weight_decay ** j for j in range(cfg.ttt_steps)]

    def build(self, models: Mapping, device: torch.device) -> nn.Module:
        self.features.to(device)
        draft: Eagle3Draft = models["draft"]
        self.target_lm_head = self.target_lm_head.to(device)
        self.draft_ids = draft.draft_to_target_ids(torch.arange(draft.config.draft_vocab_size)).to(device)
        self.in_draft_vocab = draft.t2d.clone().to(device)
        self.to_target_ids = lambda ids: self.draft_ids[ids]
        return EagleModule(draft).to(device)

    def _teacher_logits(self, hidden: Tensor, teacher_logits: Tensor | None) -> Tensor:
        if teacher_logits is not None:
            return teacher_logits
        with torch.no_grad():
            return F.linear(hidden, self.target_lm_head.float())

    def loss(self, model: nn.Module, batch: Mapping[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        hidden, aux, teacher_logits = self.features.get(batch, need_logits=True)
        teacher_logits = self._teacher_logits(hidden, teacher_logits)  # [B, S, V]: position p predicts x_{p+1}
        ids_in, aux_in = eagle_inputs(batch["input_ids"], aux)
        if model.training:
            aux_in = uniform_noise(aux_in, self.cfg.noise_width)
        outs = model(ids_in, aux_in, self.cfg.ttt_steps)
        width = ids_in.shape[1]
        # The target's distribution over the draft vocabulary, normalised once; step j reads it shifted by 1 + j.
        teacher_log_probs = losses.log_probs(teacher_logits[..., self.draft_ids], self.cfg.label_temperature)  # [B, S, V_draft]
        in_vocab = self.in_draft_vocab[teacher_logits.argmax(-1)]  # [B, S]
        components: dict[str, Tensor] = {}
        loss = teacher_logits.new_zeros(())
        for j, ((_, logits), weight) in enumerate(zip(outs, self.weights)):
            # step j at index i predicts x_{i+2+j}: the target's distribution at position i+1+j. Indices past the
            # last label are masked anyway, so the step scores the first `scored` indices only (no padded copies).
            scored = max(0, min(width, teacher_log_probs.shape[1] - 1 - j))
            labels = teacher_log_probs[:, 1 + j:1 + j + scored]
            mask = ahead_mask(batch["loss_mask"], 2 + j, scored) & in_vocab[:, 1 + j:1 + j + scored]
            step_loss = losses.forward_kl_log_target(logits[:, :scored].float(), labels, mask=mask)
            components[f"step{j + 1}"] = step_loss.detach()
            loss = loss + weight * step_loss
        return loss, components

    @torch.no_grad()
    def eval_metrics(self, model: nn.Module, batch: Mapping[str, Tensor]) -> PositionCounts:
        _, aux, _ = self.features.get(batch, need_logits=False)
        ids_in, aux_in = eagle_inputs(batch["input_ids"], aux)
        outs = model(ids_in, aux_in, self.cfg.eval_steps)
        return unrolled_counts(outs, batch["input_ids"], batch["loss_mask"], self.to_target_ids)


@register_objective("eagle3")
def build_eagle3_objective(dcfg, teacher, target_dir, draft) -> Eagle3Objective:
    from draftsmith.kernels.layers.checkpoint import load_target_embed_and_head

    _, lm_head = load_target_embed_and_head(target_dir)  # EAGLE-3 scores drafts with the target's head
    return Eagle3Objective(dcfg, teacher, lm_head, list(draft.config.aux_layers))
