"""Medusa-1 heads: K heads on the target's last hidden state (its final-norm output, the lm_head input).

Head k (1-based) is ``num_layers`` residual blocks ``x + SiLU(Linear(x))`` followed by an LM head and predicts
the token at t+k+1 from the feature at t (the target's own LM head predicts t+1). The LM head is either each
head's own (initialised from the target's, as Medusa does) or ONE frozen copy of the target's shared by all
heads. Residual linears start at zero, so an untrained head k starts out repeating the target's next token.

Heads are stateless, so the training (batch) and serving (step) APIs are the same call on any leading shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.drafts.common import count_parameters
from draftsmith.kernels.layers.config import hf_config_dict
from draftsmith.kernels.layers.decoder import Op
from draftsmith.kernels.layers.linear import Linear


@dataclass
class MedusaConfig:
    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    num_layers: int = 1
    shared_lm_head: bool = True  # True: all heads use one frozen copy of the target's lm_head

    def __post_init__(self) -> None:
        for name in ("hidden_size", "vocab_size", "num_heads", "num_layers"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"MedusaConfig.{name} must be > 0, got {getattr(self, name)}")

    @classmethod
    def from_target_config(cls, target_cfg: Any, **opts: Any) -> "MedusaConfig":
        t = hf_config_dict(target_cfg)
        return cls(hidden_size=int(t["hidden_size"]), vocab_size=int(t["vocab_size"]), **opts)


def res_step(linear: Op, x: Tensor) -> Tensor:
    """x + SiLU(linear(x)), [..., d] -> [..., d]."""
    return x + F.silu(linear(x))


def run_blocks(blocks: list[Op], x: Tensor) -> Tensor:
    for block in blocks:
        x = block(x)
    return x


class ResBlock(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(size, size)
        nn.init.zeros_(self.linear.weight)  # identity at init: heads start from the target's own prediction
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        return res_step(self.linear, x)

    def serving(self, pack: bool | None = None) -> Op:
        return partial(res_step, Linear.fuse([self.linear], pack))


@dataclass(frozen=True)
class MedusaOps:
    """What the heads call: the modules (training) or their packed serving forms (to_serving_)."""

    features: list[Op]  # per head: hidden [..., d] -> its residual blocks' output [..., d]
    shared_head: Op | None  # one LM head over all heads' features (shared_lm_head), else per_head
    per_head: list[Op] | None


class MedusaHead(nn.Module):
    def __init__(self, cfg: MedusaConfig) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([ResBlock(cfg.hidden_size) for _ in range(cfg.num_layers)])
        self.lm_head = None if cfg.shared_lm_head else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return run_blocks(list(self.blocks), x)

    def serving(self, pack: bool | None = None) -> Op:
        return partial(run_blocks, [block.serving(pack) for block in self.blocks])


class MedusaDraft(nn.Module):
    kind = "medusa"

    def __init__(self, cfg: MedusaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.heads = nn.ModuleList([MedusaHead(cfg) for _ in range(cfg.num_heads)])
        self.lm_head = None
        if cfg.shared_lm_head:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            self.lm_head.weight.requires_grad_(False)  # the target's head, frozen (Medusa-1)
        for head in self.heads:
            if head.lm_head is not None:
                nn.init.normal_(head.lm_head.weight, std=0.02)
        self.serving_ops: MedusaOps | None = None

    @classmethod
    def from_target_config(cls, target_cfg: Any, **opts: Any) -> "MedusaDraft":
        return cls(MedusaConfig.from_target_config(target_cfg, **opts))

    def init_from_target(self, target_lm_head: Tensor) -> None:
        """Copy the target's lm_head [V, d] into the shared head or into every head's own head."""
        expected = (self.config.vocab_size, self.config.hidden_size)
        if tuple(target_lm_head.shape) != expected:
            raise ValueError(f"Medusa init: target lm_head is {tuple(target_lm_head.shape)}, heads expect {expected}")
        with torch.no_grad():
            heads = [self.lm_head] if self.lm_head is not None else [h.lm_head for h in self.heads]
            for head in heads:
                head.weight.copy_(target_lm_head.to(head.weight.dtype))

    def head_lm_weight(self, k: int) -> Tensor:
        head = self.heads[k].lm_head if self.lm_head is None else self.lm_head
        return head.weight

    @property
    def ops(self) -> MedusaOps:
        if self.serving_ops is not None:
            return self.serving_ops
        per_head = None if self.lm_head is not None else [head.lm_head for head in self.heads]
        return MedusaOps(list(self.heads), self.lm_head, per_head)

    def forward(self, hidden: Tensor) -> Tensor:
        """hidden [..., d] (target final-norm output at t) -> logits [..., K, V]; [..., k, :] predicts token t+k+2."""
        ops = self.ops
        stacked = torch.stack([head(hidden) for head in ops.features], dim=-2)  # [..., K, d]
        if ops.shared_head is not None:  # one GEMM over every head's features
            return ops.shared_head(stacked)
        return torch.stack([head(stacked[..., k, :]) for k, head in enumerate(ops.per_head)], dim=-2)

    def to_serving_(self, pack: bool | None = None) -> "MedusaDraft":
        """Serving form (inference only): packed residual blocks and heads (kernels.layers.linear)."""
        features = [head.serving(pack) for head in self.heads]
        if self.lm_head is not None:
            self.serving_ops = MedusaOps(features, Linear.fuse([self.lm_head], pack), None)
        else:
            self.serving_ops = MedusaOps(features, None, [Linear.fuse([head.lm_head], pack) for head in self.heads])
        return self

    def num_parameters(self, trainable_only: bool = False) -> int:
        return count_parameters(self, trainable_only)
