"""Distillation losses, all in one module.

Conventions shared by every function:

* ``student_logits`` / ``teacher_logits``: ``[..., V]`` (any leading shape, e.g. [B, S, V] or [N, V]); P is the
  teacher distribution, Q the student's, both ``softmax(logits / temperature)`` computed via log_softmax in fp32 (fp64 kept).
* ``mask``: bool ``[...]`` (the leading shape) - True = position counts. None = all count.
* reduction: mean over the counted positions of the per-position loss (a sum over the vocabulary); an all-False
  mask gives 0 (with a gradient path), never NaN.
* no T^2 factor is applied; multiply outside if you want Hinton's gradient scaling.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


def _log_probs(logits: Tensor, temperature: float) -> Tensor:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    # at least fp32 (bf16 logits), but keep fp64 when given
    return F.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, dim=-1)


def _masked_mean(per_position: Tensor, mask: Tensor | None) -> Tensor:
    if mask is None:
        return per_position.mean()
    if mask.shape != per_position.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != positions shape {tuple(per_position.shape)}")
    mask = mask.to(torch.bool)
    total = torch.where(mask, per_position, torch.zeros_like(per_position)).sum()
    return total / mask.sum().clamp(min=1)


def _kl(log_p: Tensor, log_q: Tensor) -> Tensor:
    """KL(P || Q) per position; terms with p = 0 contribute 0 even where log q = -inf."""
    p = log_p.exp()
    return torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p)).sum(-1)


def forward_kl(student_logits: Tensor, teacher_logits: Tensor, temperature: float = 1.0, mask: Tensor | None = None) -> Tensor:
    """KL(P_teacher || Q_student): mode-covering, the classic KD objective."""
    return forward_kl_log_target(student_logits, log_probs(teacher_logits, temperature), temperature, mask)


def forward_kl_log_target(student_logits: Tensor, teacher_log_probs: Tensor, temperature: float = 1.0,
                          mask: Tensor | None = None) -> Tensor:
    """forward_kl with P given as log-probs (``log_probs(teacher_logits, temperature)``): a caller scoring several
    student outputs against slices of one teacher distribution (EAGLE-3's unrolled steps) computes it once."""
    return _masked_mean(_kl(teacher_log_probs, _log_probs(student_logits, temperature)), mask)


def log_probs(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / temperature) in at least fp32: the distributions every loss here compares."""
    return _log_probs(logits, temperature)


def reverse_kl(student_logits: Tensor, teacher_logits: Tensor, temperature: float = 1.0, mask: Tensor | None = None) -> Tensor:
    """KL(Q_student || P_teacher): mode-seeking."""
    return _masked_mean(_kl(_log_probs(student_logits, temperature), _log_probs(teacher_logits, temperature)), mask)


def generalized_jsd(
    student_logits: Tensor, teacher_logits: Tensor, beta: float = 0.5, temperature: float = 1.0, mask: Tensor | None = None
) -> Tensor:
    """Generalized JSD with mixture M = beta*P + (1-beta)*Q (P teacher, Q student):

        JSD_beta = [beta * KL(P || M) + (1 - beta) * KL(Q || M)] / (beta * (1 - beta))

    The 1/(beta(1-beta)) scale (4x the usual JSD at beta=0.5) makes the endpoints continuous limits:
    beta -> 0 gives forward KL(P || Q) and beta -> 1 gives reverse KL(Q || P), which are returned at (and within
    sqrt(eps) of) 0 and 1.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"generalized_jsd: beta must be in [0, 1], got {beta}")
    # Within sqrt(eps) of an endpoint the limit is closer than the formula: dividing by beta * (1 - beta) scales the
    # KL terms' rounding (~eps) by 1 / min(beta, 1 - beta); at beta = 1 - 1e-16 two equal float64 distributions
    # gave -0.58. The limit's own error is O(min(beta, 1 - beta)).
    near = math.sqrt(torch.finfo(torch.promote_types(student_logits.dtype, torch.float32)).eps)   # _log_probs dtype
    if beta <= near:
        return forward_kl(student_logits, teacher_logits, temperature, mask)
    if beta >= 1.0 - near:
        return reverse_kl(student_logits, teacher_logits, temperature, mask)
    log_p, log_q = _log_probs(teacher_logits, temperature), _log_probs(student_logits, temperature)
    log_m = torch.logsumexp(torch.stack([log_p + math.log(beta), log_q + math.log(1 - beta)]), dim=0)
    jsd = (beta * _kl(log_p, log_m) + (1 - beta) * _kl(log_q, log_m)) / (beta * (1 - beta))
    return _masked_mean(jsd, mask)


def total_variation(student_logits: Tensor, teacher_logits: Tensor, temperature: float = 1.0, mask: Tensor | None = None) -> Tensor:
    """TVD(P, Q) = 1/2 sum |p - q| (DistillSpec: 1 - TVD is the acceptance rate of speculative sampling)."""
    p = _log_probs(teacher_logits, temperature).exp()
    q = _log_probs(student_logits, temperature).exp()
    return _masked_mean(0.5 * (p - q).abs().sum(-1), mask)


def topk_soft_cross_entropy(
    student_logits: Tensor,
    topk_ids: Tensor,
    topk_logits: Tensor,
    temperature: float = 1.0,
    mask: Tensor | None = None,
) -> Tensor:
    """Soft CE against stored teacher top-k: -sum_j p_j log q(topk_ids_j).

    topk_ids int [..., k], topk_logits [..., k] (logits or log-probs: softmax over the k is shift-invariant).
    The teacher distribution is renormalised over the stored k; the student's log q is over its full vocab.
    """
    if topk_ids.shape != topk_logits.shape:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_logits {tuple(topk_logits.shape)} must match")
    p = _log_probs(topk_logits, temperature).exp()
    log_q = _log_probs(student_logits, temperature).gather(-1, topk_ids.long())
    return _masked_mean(-(p * log_q).sum(-1), mask)


def hard_cross_entropy(
    student_logits: Tensor, target_ids: Tensor, temperature: float = 1.0, mask: Tensor | None = None, ignore_index: int = -100
) -> Tensor:
    """CE on the target's tokens (sequence-level KD); ``target_ids == ignore_index`` positions are masked out too."""
    keep = target_ids != ignore_index
    mask = keep if mask is None else (mask.to(torch.bool) & keep)
    log_q = _log_probs(student_logits, temperature)
    nll = -log_q.gather(-1, target_ids.clamp(min=0).long()[..., None])[..., 0]
    return _masked_mean(nll, mask)


def feature_smooth_l1(pred: Tensor, target: Tensor, mask: Tensor | None = None, beta: float = 1.0) -> Tensor:
    """EAGLE-1 feature regression: smooth-L1 averaged over the feature dim, then over the counted positions."""
    if pred.shape != target.shape:
        raise ValueError(f"feature_smooth_l1: pred {tuple(pred.shape)} vs target {tuple(target.shape)}")
    dtype = torch.promote_types(pred.dtype, torch.float32)
    per_position = F.smooth_l1_loss(pred.to(dtype), target.to(dtype), reduction="none", beta=beta).mean(-1)
    return _masked_mean(per_position, mask)


DIVERGENCES: dict[str, Callable[..., Tensor]] = {
    "forward_kl": forward_kl,
    "reverse_kl": reverse_kl,
    "jsd": generalized_jsd,
    "tv": total_variation,
}


def divergence(name: str, student_logits: Tensor, teacher_logits: Tensor, **kwargs) -> Tensor:
    """Dispatch by config name: forward_kl | reverse_kl | jsd (takes beta) | tv."""
    if name not in DIVERGENCES:
        raise ValueError(f"divergence: {name!r} is not one of {sorted(DIVERGENCES)}")
    return DIVERGENCES[name](student_logits, teacher_logits, **kwargs)
