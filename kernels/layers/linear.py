"""The serving form of a projection: y = x @ W^T + b, with W pre-packed for oneDNN where that pays.

On CPU, torch's plain bf16 GEMV re-lays out the weight on every call; a weight packed once at load runs a
batch-1 projection about 1.5-2x faster (measured by scripts/bench_roofline.py). fp32 keeps MKL's plain path,
which is as fast and is the one the exactness tests pin; CUDA keeps cuBLAS.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def should_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether oneDNN-packed weights are the fast path for this dtype and device."""
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class Linear:
    """Inference-only linear over [T, in] rows; a plain object, so a call costs no nn.Module dispatch."""

    def __init__(self, weight: Tensor, bias: Tensor | None, pack: bool | None = None) -> None:
        self.weight = weight.detach()  # [out, in], plain; kept for anything that needs the dense matrix
        self.bias = None if bias is None else bias.detach()  # [out] or None
        if pack is None:
            pack = should_pack(self.weight.dtype, self.weight.device)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 1) if pack else None

    @classmethod
    def fuse(cls, linears: Sequence[nn.Linear], pack: bool | None = None) -> "Linear":
        """One matrix for several projections of the same input (q/k/v, gate/up): outputs concatenated."""
        if any(getattr(m, "is_quantized", False) for m in linears):  # weight-only int8/int4 (kernels.quant)
            from kernels.quant import fuse_quantized

            return fuse_quantized(linears)
        weights = [m.weight.detach() for m in linears]
        biases = [m.bias for m in linears]
        if any(b is None for b in biases) and not all(b is None for b in biases):
            raise ValueError("fused projections must all have a bias or none")
        if len(linears) == 1:
            return cls(weights[0], biases[0], pack)
        weight = torch.cat(weights, dim=0)
        bias = None if biases[0] is None else torch.cat([b.detach() for b in biases], dim=0)
        # The modules' parameters become views of the fused matrix, so fusing a large target does not keep
        # two copies of every projection (state_dict and parameters() still read the same values).
        sizes = [w.shape[0] for w in weights]
        with torch.no_grad():
            for module, w, b in zip(linears, weight.split(sizes), [None] * len(sizes) if bias is None else bias.split(sizes)):
                module.weight.data = w
                if b is not None:
                    module.bias.data = b
        return cls(weight, bias, pack)

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    def repack(self, pack: bool) -> None:
        """Switch between the packed and the plain path (torch.compile traces plain matmuls only)."""
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 1) if pack else None

    def __call__(self, x: Tensor) -> Tensor:
        """x: [..., in] -> [..., out]."""
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        if x.dim() != 2:  # oneDNN's packed GEMM takes 2-D input
            return self(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [None], "")

    def nbytes(self) -> int:
        """Bytes of weights (and bias) a forward reads."""
        tensors = [self.weight] if self.bias is None else [self.weight, self.bias]
        return sum(t.numel() * t.element_size() for t in tensors)

