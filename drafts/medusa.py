"""Medusa-1 heads: K heads on the target's last hidden state (its final-norm output, the lm_head input).

Head k (1-based) is ``num_layers`` residual blocks ``x + SiLU(Linear(x))`` followed by an LM head and predicts
the token at t+k+1 from the feature at t (the target's own LM head predicts t+1). The LM head is either each
head's own (initialised from the target's, as Medusa does) or ONE frozen copy of the target's shared by all
heads. Residual linears start at zero, so an untrained head k starts out repeating the target's next token.

Heads are stateless, so the training (batch) and serving (step) APIs are the same call on any leading shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from drafts.common import count_parameters, hf_config_dict


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


class ResBlock(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(size, size)
        nn.init.zeros_(self.linear.weight)  # identity at init: heads start from the target's own prediction
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        return x + F.silu(self.linear(x))


class MedusaHead(nn.Module):
    def __init__(self, cfg: MedusaConfig) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([ResBlock(cfg.hidden_size) for _ in range(cfg.num_layers)])
        self.lm_head = None if cfg.shared_lm_head else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return x


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

    def forward(self, hidden: Tensor) -> Tensor:
        """hidden [..., d] (target final-norm output at t) -> logits [..., K, V]; [..., k, :] predicts token t+k+2."""
        return torch.stack([F.linear(head(hidden), self.head_lm_weight(k)) for k, head in enumerate(self.heads)], dim=-2)

    def num_parameters(self, trainable_only: bool = False) -> int:
        return count_parameters(self, trainable_only)
