"""Standalone draft objective: sequence-level KD, token-level KD, and on-policy (GKD-style) batches.

* sequence_kd: hard cross-entropy on the target's own tokens (the regenerated answers).
* token_kd: any divergence of train.losses between the draft's and the target's next-token distributions;
  the target's come from the stored top-k log-probs (the rest of the mass spread evenly over the other
  tokens, so reverse KL stays finite), from the cached final-norm hidden through the target's LM head
  (teacher=hidden: the full distribution, no target forward; it matters when the target is flat: the
  embedded target's top-16 hold ~0.42 of the mass, and a draft taught an even tail proposes tokens at T=1
  the target rarely samples), or from the target run inside the loop (online).
* on_policy_fraction: that share of training batches is rewritten before the loss: the draft continues each
  prompt itself, the target scores those tokens, and the divergence is taken on them (Agarwal et al. GKD).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping

import torch
from torch import Tensor, nn

from draftsmith.drafts.standalone import StandaloneDraft
from draftsmith.train import losses
from draftsmith.train.distill.objective import PositionCounts
from draftsmith.train.distill.objectives.common import (
    chain_counts,
    next_token_mask,
    shift_left,
    unwrap,
)
from draftsmith.train.distill.objectives.registry import register_objective
from draftsmith.train.distill.objectives.teacher import Teacher


class StandaloneModule(nn.Module):
    def __init__(self, draft: StandaloneDraft) -> None:
        super().__init__()
        self.draft = draft

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.draft.forward_batch(input_ids)  # [B, S, V]


def topk_to_logprobs(topk_ids: Tensor, topk_logprobs: Tensor, vocab_size: int) -> Tensor:
    """[..., k] stored top-k -> full log-probs [..., V]: the mass outside the top-k spread evenly over the rest."""
    k = topk_ids.shape[-1]
    kept = topk_logprobs.float().exp().sum(-1, keepdim=True).clamp(max=1.0)
    rest = (1.0 - kept).clamp(min=1e-12).log() - math.log(max(1, vocab_size - k))
    out = rest.expand(*topk_ids.shape[:-1], vocab_size).clone()
    return out.scatter(-1, topk_ids.long(), topk_logprobs.float())


def _agreed_across_ranks(flag: bool, device: torch.device) -> bool:
    """Rank 0's draw for every rank. Each rank seeds its own random stream, but an on-policy batch calls the
    target, and a target sharded across the ranks (launcher.shard_target) gathers its weights collectively:
    ranks that disagreed would wait on each other for ever."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return flag
    if torch.distributed.get_world_size() == 1:
        return flag
    agreed = torch.tensor([int(flag)], device=device)
    torch.distributed.broadcast(agreed, src=0)
    return bool(agreed.item())


TEACHERS = ("auto", "topk", "hidden", "online")


class StandaloneObjective:
    def __init__(self, cfg, teacher: Teacher | None, num_eval_positions: int = 4,
                 target_lm_head: Tensor | None = None) -> None:
        self.cfg, self.teacher, self.num_eval_positions = cfg, teacher, num_eval_positions
        self.target_lm_head = target_lm_head  # [V, d_target], frozen: teacher=hidden only
        if cfg.loss not in ("sequence_kd", "token_kd"):
            raise ValueError(f"draft.loss: {cfg.loss!r} is not one of ('sequence_kd', 'token_kd')")
        if cfg.divergence not in losses.DIVERGENCES:
            raise ValueError(f"draft.divergence: {cfg.divergence!r} is not one of {sorted(losses.DIVERGENCES)}")
        if not 0.0 <= cfg.on_policy_fraction <= 1.0:
            raise ValueError(f"draft.on_policy_fraction must be in [0, 1], got {cfg.on_policy_fraction}")
        needs_teacher = cfg.on_policy_fraction > 0 or (cfg.loss == "token_kd" and self.teacher_kind() == "online")
        if needs_teacher and teacher is None:
            raise ValueError("draft: token_kd with teacher=online and on-policy batches need the target in the loop")
        if cfg.loss == "token_kd" and self.teacher_kind() == "hidden" and target_lm_head is None:
            raise ValueError("draft.teacher=hidden: the objective needs the target's LM head")

    def teacher_kind(self) -> str:
        if self.cfg.teacher == "auto":
            return "topk" if self.cfg.data.topk_logits > 0 else "online"
        if self.cfg.teacher not in TEACHERS:
            raise ValueError(f"draft.teacher: {self.cfg.teacher!r} is not one of {TEACHERS}")
        return self.cfg.teacher

    def build(self, models: Mapping, device: torch.device) -> nn.Module:
        if self.teacher is not None:
            self.teacher.to(device)
        self.vocab_size = models["draft"].config.vocab_size
        if self.target_lm_head is not None:
            self.target_lm_head = self.target_lm_head.to(device)
        return StandaloneModule(models["draft"]).to(device)

    def _divergence(self, student: Tensor, teacher_logits: Tensor, mask: Tensor) -> Tensor:
        kwargs = {"beta": self.cfg.jsd_beta} if self.cfg.divergence == "jsd" else {}
        return losses.divergence(self.cfg.divergence, student, teacher_logits,
                                 temperature=self.cfg.kd_temperature, mask=mask, **kwargs)

    @torch.no_grad()
    def _on_policy(self, model: nn.Module, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The batch's prompts continued by the draft (sampled), as a new batch whose loss_mask marks them."""
        draft: StandaloneDraft = unwrap(model).draft
        input_ids, loss_mask, attention = batch["input_ids"], batch["loss_mask"], batch["attention_mask"]
        B, S = input_ids.shape
        has_answer = loss_mask.any(1)
        first_answer = torch.where(has_answer, loss_mask.float().argmax(1), attention.sum(1)).clamp(min=1)
        new_tokens = self.cfg.on_policy_new_tokens
        width = int(first_answer.max()) + new_tokens
        ids = shift_left(input_ids, 0, width, 0)
        rows = torch.arange(B, device=ids.device)
        for step in range(new_tokens):
            logits = draft.forward_batch(ids[:, : int(first_answer.max()) + step])
            last = logits[rows, first_answer + step - 1].float()
            if self.cfg.on_policy_temperature > 0:
                probs = torch.softmax(last / self.cfg.on_policy_temperature, -1)
                token = torch.multinomial(probs, 1)[:, 0]
            else:
                token = last.argmax(-1)
            ids[rows, first_answer + step] = token
        position = torch.arange(width, device=ids.device)[None, :]
        end = (first_answer + new_tokens)[:, None]
        return {"input_ids": ids, "attention_mask": position < end,
                "loss_mask": (position >= first_answer[:, None]) & (position < end)}

    def loss(self, model: nn.Module, batch: Mapping[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        on_policy = model.training and self.cfg.on_policy_fraction > 0 and _agreed_across_ranks(
            random.random() < self.cfg.on_policy_fraction, batch["input_ids"].device)
        if on_policy:
            batch = self._on_policy(model, batch)
        logits = model(batch["input_ids"])
        mask = next_token_mask(batch["loss_mask"])
        targets = shift_left(batch["input_ids"], 1, batch["input_ids"].shape[1], 0)
        components: dict[str, Tensor] = {}
        if self.cfg.loss == "sequence_kd" and not on_policy:
            loss = losses.hard_cross_entropy(logits, targets, mask=mask)
            components["hard_ce"] = loss.detach()
            return loss, components
        teacher_logits = self._teacher_logits(batch, on_policy, logits.shape[-1])
        kd = self._divergence(logits, teacher_logits, mask)
        components[self.cfg.divergence] = kd.detach()
        loss = kd
        if self.cfg.hard_weight > 0 and not on_policy:
            hard = losses.hard_cross_entropy(logits, targets, mask=mask)
            components["hard_ce"] = hard.detach()
            loss = loss + self.cfg.hard_weight * hard
        components["on_policy"] = torch.tensor(float(on_policy))
        return loss, components

    @torch.no_grad()
    def _teacher_logits(self, batch: Mapping[str, Tensor], on_policy: bool, vocab_size: int) -> Tensor:
        """The target's next-token logits (or log-probs) per position [B, S, V], aligned with the draft's."""
        if on_policy or self.teacher_kind() == "online":
            return self.teacher(batch["input_ids"], batch["attention_mask"]).logits
        if self.teacher_kind() == "hidden":
            if "hidden" not in batch:
                raise ValueError("token_kd with teacher=hidden: batch has no field 'hidden' (the dataset must store "
                                 "the target's final hidden states)")
            return torch.nn.functional.linear(batch["hidden"].float(), self.target_lm_head.float())
        for name in ("topk_ids", "topk_logprobs"):
            if name not in batch:
                raise ValueError(f"token_kd with teacher=topk: batch has no field '{name}' (set draft.data.topk_logits > 0)")
        return topk_to_logprobs(batch["topk_ids"], batch["topk_logprobs"], vocab_size)

    @torch.no_grad()
    def eval_metrics(self, model: nn.Module, batch: Mapping[str, Tensor]) -> PositionCounts:
        """Teacher-forced chain: the k-th token of a round starting at answer position j is the draft's
        argmax at j+k-1 given the target's tokens, so depth k counts hits of rounds with k tokens of room."""
        logits = model(batch["input_ids"])
        mask = next_token_mask(batch["loss_mask"])
        hits = logits.argmax(-1) == shift_left(batch["input_ids"], 1, batch["input_ids"].shape[1], 0)
        hit_list, valid_list = [], []
        for depth in range(self.num_eval_positions):
            # round start p is valid and position p + depth is still inside the answer
            valid = mask[:, depth:] & mask[:, : mask.shape[1] - depth]
            hit_list.append(hits[:, depth:])
            valid_list.append(valid)
        return chain_counts(hit_list, valid_list)


@register_objective("standalone")
def build_standalone_objective(dcfg, teacher, target_dir, draft) -> StandaloneObjective:
    lm_head = None
    if dcfg.loss == "token_kd" and dcfg.teacher == "hidden":
        from draftsmith.kernels.layers.checkpoint import load_target_embed_and_head

        _, lm_head = load_target_embed_and_head(target_dir)
    return StandaloneObjective(dcfg, teacher, target_lm_head=lm_head)
