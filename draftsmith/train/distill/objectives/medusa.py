"""Medusa objective: heads on the target's final-norm hidden state.

Medusa-1: the target is frozen; head k (0-based) at position t learns token t+k+2 with weight
``head_weight_decay ** k`` (deeper heads are less certain; the Medusa paper uses 0.8^k).
Medusa-2 (``medusa2=true``): the target trains jointly through LoRA deltas on its projections (the
base weights stay frozen, so the update is small and cheap), with its own LM loss kept in the sum
so its outputs stay the target's. Export merges the deltas into a NEW target dir (new fingerprint).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from draftsmith.drafts.medusa import MedusaDraft
from draftsmith.train import losses
from draftsmith.train.distill.objective import PositionCounts
from draftsmith.train.distill.objectives.common import (
    FeatureSource,
    ahead_mask,
    chain_counts,
    next_token_mask,
    shift_left,
)
from draftsmith.train.distill.objectives.registry import register_objective
from draftsmith.train.distill.objectives.teacher import Teacher

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRADelta(nn.Module):
    """weight -> weight + (alpha / rank) * B @ A; B starts at zero, so training starts at the target."""

    def __init__(self, out_features: int, in_features: int, rank: int, alpha: float) -> None:
        super().__init__()
        self.lora_a = nn.Parameter(torch.randn(rank, in_features) / rank)
        self.lora_b = nn.Parameter(torch.zeros(out_features, rank))
        self.scale = alpha / rank

    def forward(self, weight: Tensor) -> Tensor:
        return weight + self.scale * (self.lora_b @ self.lora_a).to(weight.dtype)


def add_lora(target: nn.Module, rank: int, alpha: float) -> int:
    """Freeze the target and put LoRA deltas on its projections; returns how many layers got one."""
    if rank < 1:
        raise ValueError(f"draft.lora_rank must be >= 1, got {rank}")
    target.requires_grad_(False)
    count = 0
    for name, module in target.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in LORA_TARGETS:
            parametrize.register_parametrization(module, "weight", LoRADelta(module.out_features, module.in_features, rank, alpha))
            count += 1
    if count == 0:
        raise ValueError(f"Medusa-2: the target has none of the projections {LORA_TARGETS} to adapt")
    return count


def merge_lora(target: nn.Module) -> None:
    """Fold the deltas into plain weights (for saving the adapted target)."""
    for module in target.modules():
        if parametrize.is_parametrized(module, "weight"):
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)


class MedusaModule(nn.Module):
    def __init__(self, heads: MedusaDraft, target: nn.Module | None = None) -> None:
        super().__init__()
        self.heads = heads
        self.target = target  # Medusa-2 only: the LoRA-adapted target trains with the heads

    def forward(self, hidden: Tensor | None = None, input_ids: Tensor | None = None,
                attention_mask: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Medusa-1: hidden [B,S,d] -> head logits [B,S,K,V]. Medusa-2: ids -> (head logits, target logits)."""
        if self.target is None:
            return self.heads(hidden), None
        out = self.target.model(input_ids=input_ids, attention_mask=attention_mask.long())
        hidden = out.last_hidden_state
        return self.heads(hidden), self.target.lm_head(hidden)


class MedusaObjective:
    def __init__(self, cfg, teacher: Teacher | None) -> None:
        self.cfg = cfg
        if cfg.medusa2 and cfg.mode != "online":
            raise ValueError("draft.medusa2=true trains the target, so draft.mode must be online (got offline)")
        self.features = None if cfg.medusa2 else FeatureSource(cfg.mode, teacher)
        self.teacher = teacher
        self.weights = [cfg.head_weight_decay ** k for k in range(cfg.num_heads)]

    def build(self, models: Mapping, device: torch.device) -> nn.Module:
        target = None
        if self.cfg.medusa2:
            target = self.teacher.model
            add_lora(target, self.cfg.lora_rank, self.cfg.lora_alpha)
        elif self.features is not None:
            self.features.to(device)
        return MedusaModule(models["draft"], target).to(device)

    def _forward(self, model: nn.Module, batch: Mapping[str, Tensor]) -> tuple[Tensor, Tensor | None]:
        if self.cfg.medusa2:
            return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        hidden, _, _ = self.features.get(batch, need_logits=False)
        return model(hidden=hidden)

    def loss(self, model: nn.Module, batch: Mapping[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        head_logits, target_logits = self._forward(model, batch)
        ids, loss_mask = batch["input_ids"], batch["loss_mask"]
        S = ids.shape[1]
        components: dict[str, Tensor] = {}
        loss = head_logits.new_zeros(())
        for k, weight in enumerate(self.weights):
            ce = losses.hard_cross_entropy(head_logits[:, :, k], shift_left(ids, k + 2, S), mask=ahead_mask(loss_mask, k + 2, S))
            components[f"head{k + 1}"] = ce.detach()
            loss = loss + weight * ce
        if target_logits is not None:
            lm = losses.hard_cross_entropy(target_logits, shift_left(ids, 1, S), mask=next_token_mask(loss_mask))
            components["target_lm"] = lm.detach()
            loss = loss + self.cfg.lm_loss_weight * lm
        return loss, components

    @torch.no_grad()
    def eval_metrics(self, model: nn.Module, batch: Mapping[str, Tensor]) -> PositionCounts:
        """Head k's top-1 against token t+k+2 (draft position k+2 counts as chain depth k+1 after the
        target's own next token, which the verify step always supplies)."""
        head_logits, _ = self._forward(model, batch)
        ids, loss_mask = batch["input_ids"], batch["loss_mask"]
        S = ids.shape[1]
        predictions = head_logits.argmax(-1)
        hits = [predictions[:, :, k] == shift_left(ids, k + 2, S) for k in range(self.cfg.num_heads)]
        valid = [ahead_mask(loss_mask, k + 2, S) for k in range(self.cfg.num_heads)]
        return chain_counts(hits, valid)


@register_objective("medusa")
def build_medusa_objective(dcfg, teacher, target_dir, draft) -> MedusaObjective:
    return MedusaObjective(dcfg, teacher)
