"""Top-k routed experts over flattened tokens (HF Qwen3-MoE / Qwen2-MoE sparse blocks), training and serving.

Parameters carry transformers' in-memory names (``gate.weight`` [E, d], ``experts.gate_up_proj`` [E, 2I, d],
``experts.down_proj`` [E, d, I], Qwen2-MoE's ``shared_expert.*`` and ``shared_expert_gate.weight`` [1, d]);
checkpoints on disk name each expert (``experts.{e}.gate_proj.weight``...), which ``fuse_expert_weights`` stacks.
The math follows HF's order (fp32 router softmax, top-k, optional renormalisation, cast, weighted index_add) so
the engine's logits match transformers to fp32 rounding.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.kernels.layers.config import DecoderConfig
from draftsmith.kernels.layers.family import MoEConfig

_EXPERT_KEY = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class Experts(nn.Module):
    def __init__(self, hidden: int, moe: MoEConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(moe.num_experts, 2 * moe.intermediate_size, hidden))
        self.down_proj = nn.Parameter(torch.empty(moe.num_experts, hidden, moe.intermediate_size))


class SharedExpert(nn.Module):
    """Qwen2-MoE's dense expert every token goes through (HF Qwen2MoeMLP names)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def route(router_logits: Tensor, moe: MoEConfig) -> tuple[Tensor, Tensor]:
    """router_logits [T, E] -> (weights [T, k] in the logits' dtype, expert ids int64 [T, k])."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float)
    weights, experts = torch.topk(probs, moe.top_k, dim=-1)
    if moe.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), experts


def routed_experts(x: Tensor, weights: Tensor, experts: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    """x [T, d]; weights, experts [T, k]; gate_up [E, 2I, d]; down [E, d, I] -> [T, d].

    Only the experts some token chose run, each over just its tokens (one [n_e, d] GEMM pair per expert)."""
    out = torch.zeros_like(x)
    flat = experts.reshape(-1)  # [T*k]
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    token_of = order // experts.shape[1]  # [T*k] token of each (sorted) assignment
    weight_of = weights.reshape(-1).index_select(0, order)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        tokens = token_of[start:start + count]
        gate, up = F.linear(x.index_select(0, tokens), gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[expert]) * weight_of[start:start + count, None]
        out.index_add_(0, tokens, y.to(out.dtype))
        start += count
    return out


class SparseMoE(nn.Module):
    """The MLP of a sparse layer: x [T, d] -> [T, d]."""

    def __init__(self, cfg: DecoderConfig, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.gate = nn.Linear(cfg.hidden_size, moe.num_experts, bias=False)
        self.experts = Experts(cfg.hidden_size, moe)
        if moe.shared_intermediate_size:
            self.shared_expert = SharedExpert(cfg.hidden_size, moe.shared_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        weights, experts = route(self.gate(x), self.moe)
        out = routed_experts(x, weights, experts, self.experts.gate_up_proj, self.experts.down_proj)
        if self.moe.shared_intermediate_size:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def serving(self, pack: bool | None = None):
        """The serving form is the module's own forward: routing is data-dependent, nothing to pre-fuse."""
        return self.forward


def fuse_expert_weights(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Per-expert checkpoint names -> the stacked ``experts.gate_up_proj`` / ``experts.down_proj``; other keys
    (and already stacked ones) pass through. ValueError when an expert of a layer is missing."""
    groups: dict[str, dict[int, dict[str, Tensor]]] = {}
    out: dict[str, Tensor] = {}
    for key, tensor in state.items():
        match = _EXPERT_KEY.match(key)
        if match is None:
            out[key] = tensor
            continue
        prefix, index, proj = match.group(1), int(match.group(2)), match.group(3)
        groups.setdefault(prefix, {}).setdefault(index, {})[proj] = tensor
    for prefix, experts in groups.items():
        ids = sorted(experts)
        if ids != list(range(len(ids))) or any(len(experts[i]) != 3 for i in ids):
            raise ValueError(f"checkpoint: {prefix} has an incomplete set of experts (ids {ids[:3]}...)")
        out[prefix + ".gate_up_proj"] = torch.stack(
            [torch.cat([experts[i]["gate_proj"], experts[i]["up_proj"]], dim=0) for i in ids])
        out[prefix + ".down_proj"] = torch.stack([experts[i]["down_proj"] for i in ids])
    return out
