"""Block-parallel (DFlash-style) objective: from sampled anchors, predict the next K tokens in one forward.

Per answer, ``max_anchors`` block roots a are sampled among the positions whose next token is an answer token
(the global torch RNG while training, restored on resume; a fixed generator on held-out batches, so the
held-out loss is comparable across evaluations). Block offset j (1..K) at anchor a proposes x_{a+j}; its label
is the target's distribution at position a+j-1 (which predicts x_{a+j}), weighted ``position_weight_decay **
(j - 1)`` (near offsets matter most: a later token is only emitted when every earlier one was accepted).

The target's distribution comes from (``teacher``):
* online: the target forward inside the loop (its logits);
* offline: the cached final-norm hidden through the target's LM head (``auto`` / ``hidden``: the full
  distribution; the draft's frozen head IS the target's), or the stored top-k log-probs (``topk``: soft CE over
  the k; the job then asks the dataset for them).

Held-out counts are CONDITIONAL on the block's earlier offsets: offset j is counted where offsets 1..j-1 all
matched the data token, which is the acceptance a chain verifier applies (simulated_tau reads them so).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.train import losses
from draftsmith.train.distill.objective import PositionCounts
from draftsmith.train.distill.objectives.common import FeatureSource, ahead_mask, chain_counts
from draftsmith.train.distill.objectives.registry import register_objective
from draftsmith.train.distill.objectives.teacher import Teacher

TEACHERS = ("auto", "topk", "hidden")
EVAL_SEED = 0


class BlockModule(nn.Module):
    def __init__(self, draft: nn.Module) -> None:
        super().__init__()
        self.draft = draft

    def forward(self, input_ids: Tensor, aux: Tensor, anchors: Tensor) -> Tensor:
        """-> logits [B, N, K, V] (see drafts.block.BlockDraft.anchor_forward)."""
        return self.draft.anchor_forward(input_ids, aux, anchors)


def sample_anchors(loss_mask: Tensor, count: int, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Up to ``count`` distinct anchors per row among positions a with loss_mask[a + 1] (an answer token next).

    loss_mask [B, S] -> (anchors int64 [B, N], valid bool [B, N]); invalid slots point at 0 and are masked."""
    B, S = loss_mask.shape
    candidate = ahead_mask(loss_mask, 1, S)  # [B, S]
    scores = torch.rand(B, S, generator=generator).to(loss_mask.device)
    scores = scores.masked_fill(~candidate, -1.0)
    top = scores.topk(min(count, S), dim=1)
    valid = top.values >= 0
    return torch.where(valid, top.indices, torch.zeros_like(top.indices)), valid


def offset_index(anchors: Tensor, valid: Tensor, loss_mask: Tensor, num_offsets: int) -> tuple[Tensor, Tensor]:
    """Positions a + j (j = 1..K) and where they are scored: ([B, N, K] int64 clamped into range, bool [B, N, K])."""
    S = loss_mask.shape[1]
    pos = anchors[:, :, None] + torch.arange(1, num_offsets + 1, device=anchors.device)  # [B, N, K]
    inside = pos < S
    pos = pos.clamp(max=S - 1)
    scored = loss_mask.bool().gather(1, pos.flatten(1)).view_as(pos)
    return pos, valid[:, :, None] & inside & scored


def gather_positions(x: Tensor, pos: Tensor) -> Tensor:
    """x [B, S, *] at pos [B, N, K] -> [B, N, K, *]."""
    B, N, K = pos.shape
    flat = pos.reshape(B, N * K)
    index = flat.view(B, N * K, *([1] * (x.dim() - 2))).expand(B, N * K, *x.shape[2:])
    return x.gather(1, index).view(B, N, K, *x.shape[2:])


class BlockObjective:
    def __init__(self, cfg, teacher: Teacher | None, aux_layers: list[int], block_size: int) -> None:
        # max_anchors and label_temperature: train.recipes.check_recipe, which every job runs before building this
        if cfg.teacher not in TEACHERS:
            raise ValueError(f"draft.teacher: {cfg.teacher!r} is not one of {TEACHERS}")
        self.cfg = cfg
        self.features = FeatureSource(cfg.mode, teacher, aux_layers)
        self.num_offsets = block_size - 1
        self.weights = [cfg.position_weight_decay ** j for j in range(self.num_offsets)]

    def build(self, models: Mapping, device: torch.device) -> nn.Module:
        self.features.to(device)
        self.lm_head = models["draft"].lm_head.weight.detach()  # the target's, frozen (offline labels)
        return BlockModule(models["draft"]).to(device)

    def _anchors(self, model: nn.Module, loss_mask: Tensor, count: int) -> tuple[Tensor, Tensor]:
        generator = None if model.training else torch.Generator().manual_seed(EVAL_SEED)
        return sample_anchors(loss_mask, count, generator)

    def _position_loss(self, logits: Tensor, batch: Mapping[str, Tensor], hidden: Tensor, teacher_logits: Tensor | None,
                       pos: Tensor, mask: Tensor) -> Tensor:
        """Divergence per offset against the target's distribution at position a + j - 1 -> [K] losses."""
        prev = (pos - 1).clamp(min=0)
        use_topk = teacher_logits is None and self.cfg.teacher != "hidden" and "topk_ids" in batch
        if self.cfg.teacher == "topk" and teacher_logits is None and "topk_ids" not in batch:
            raise ValueError("draft.teacher=topk: the dataset has no stored top-k (set draft.data.topk_logits > 0)")
        if use_topk:
            if self.cfg.label_temperature != 1.0:
                raise ValueError(f"draft.label_temperature: {self.cfg.label_temperature} sharpens logit labels, but "
                                 "this run's teacher is the stored top-k (set draft.teacher=hidden)")
            ids, lps = gather_positions(batch["topk_ids"], prev), gather_positions(batch["topk_logprobs"], prev)
            return torch.stack([losses.topk_soft_cross_entropy(logits[:, :, j].float(), ids[:, :, j], lps[:, :, j].float(),
                                                               mask=mask[:, :, j]) for j in range(self.num_offsets)])
        if teacher_logits is None:  # offline: the cached final hidden through the target's head
            with torch.no_grad():
                teacher_logits = F.linear(gather_positions(hidden, prev), self.lm_head.to(hidden.device).float())
        else:
            teacher_logits = gather_positions(teacher_logits, prev)
        teacher_logits = teacher_logits / self.cfg.label_temperature   # the labels only: the draft is served at T=0
        return torch.stack([losses.forward_kl(logits[:, :, j].float(), teacher_logits[:, :, j], mask=mask[:, :, j])
                            for j in range(self.num_offsets)])

    def loss(self, model: nn.Module, batch: Mapping[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        hidden, aux, teacher_logits = self.features.get(batch, need_logits=self.cfg.mode == "online")
        anchors, valid = self._anchors(model, batch["loss_mask"], self.cfg.max_anchors)
        pos, mask = offset_index(anchors, valid, batch["loss_mask"], self.num_offsets)
        logits = model(batch["input_ids"], aux, anchors)  # [B, N, K, V]
        per_offset = self._position_loss(logits, batch, hidden, teacher_logits, pos, mask)
        weights = per_offset.new_tensor(self.weights)
        loss = (weights * per_offset).sum()
        return loss, {f"offset{j + 1}": per_offset[j].detach() for j in range(self.num_offsets)}

    @torch.no_grad()
    def eval_metrics(self, model: nn.Module, batch: Mapping[str, Tensor]) -> PositionCounts:
        _, aux, _ = self.features.get(batch, need_logits=False)
        anchors, valid = self._anchors(model, batch["loss_mask"], self.cfg.eval_anchors)
        pos, mask = offset_index(anchors, valid, batch["loss_mask"], self.num_offsets)
        hit = model(batch["input_ids"], aux, anchors).argmax(-1) == gather_positions(batch["input_ids"], pos)
        # offset j counts where 1..j-1 all hit: the conditional acceptance of a chain verifier
        before = torch.cat([torch.ones_like(hit[..., :1]), (hit & mask).cumprod(-1)[..., :-1].bool()], dim=-1)
        return chain_counts([hit[..., j] for j in range(self.num_offsets)],
                            [mask[..., j] & before[..., j] for j in range(self.num_offsets)])


@register_objective("block")
def build_block_objective(dcfg, teacher, target_dir, draft) -> BlockObjective:
    return BlockObjective(dcfg, teacher, list(draft.config.aux_layers), draft.config.block_size)
