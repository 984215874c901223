"""RMSNorm: the functional form (serving hot path) and the module (training, HF parameter name ``weight``)."""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x: [T, d]; weight: [d]. Normalizes in fp32, casts back, then scales (HF order).

    torch's rms_norm without a weight is exactly HF's fp32 x * rsqrt(mean(x^2) + eps) cast back (bit-identical,
    checked for fp32 and bf16) in one call instead of six small ops; the weight multiplies after the cast as in HF.
    """
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


def rms_norm_fp32_inference(x: Tensor, weight: Tensor, width: Tensor, eps: Tensor) -> Tensor:
    """rms_norm for fp32 x without autograd, bit-identical to it and to HF's formula, in fewer dispatches.
    width, eps: 0-d fp32 tensors holding x.shape[-1] and the epsilon.

    On CPU torch's rms_norm runs as a composite of small ops, and its ``mean`` is itself sum + div, so at
    serving sizes (a few rows of a few hundred values) the call costs dispatch, not arithmetic: ~44 us per
    call with the weight on a 2-core AVX2 EPYC, two calls per layer. Spelled out with in-place ops on the
    fresh temporaries (x*x is pow(x, 2); sum then div_ is how CPU mean computes) it is the same arithmetic in
    the same order, ~25 us. The constants are 0-d tensors because wrapping a Python scalar costs ~5 us per op
    there (div_(256) 8.3 us, div_ by a 0-d tensor 3.2)."""
    inv_rms = (x * x).sum(-1, keepdim=True).div_(width).add_(eps).rsqrt_()
    return (x * inv_rms).mul_(weight)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:  # [..., d] -> [..., d]
        return rms_norm(x, self.weight, self.eps)

    def serving(self) -> Callable[[Tensor], Tensor]:
        """The same norm without nn.Module call overhead (serving form, inference only)."""
        weight = self.weight.detach()
        if weight.dtype == torch.float32:
            constants = torch.tensor(float(weight.shape[0])), torch.tensor(self.eps, dtype=torch.float32)
            return partial(_serving_norm, weight=weight, eps=self.eps, constants=constants)
        return partial(rms_norm, weight=weight, eps=self.eps)


def _serving_norm(x: Tensor, weight: Tensor, eps: float, constants: tuple[Tensor, Tensor]) -> Tensor:
    """fp32 weights: the fast form for fp32 activations; others (autocast) take torch's upcasting rms_norm."""
    if x.dtype == torch.float32 and not torch.is_grad_enabled():
        return rms_norm_fp32_inference(x, weight, *constants)
    return rms_norm(x, weight, eps)
