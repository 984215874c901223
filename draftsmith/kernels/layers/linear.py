"""The serving form of a projection: y = x @ W^T + b, with W pre-packed for oneDNN where that pays.

On CPU, torch's plain bf16 GEMV re-lays out the weight on every call; a weight packed once at load runs a
batch-1 projection about 1.5-2x faster (measured by scripts/bench_roofline.py). fp32 on CPU stores the weight
transposed, [in, out] row-major, and calls ``addmm(b, x, W^T)`` with no transpose flag: with the weights coming
from DRAM, as a 20-layer target's do every step, MKL's sgemm runs that layout 1.2-1.4x faster than
``F.linear``'s [out, in] at every row count from 1 to 64 (one target's worth of matmuls at 1 thread: 5.5 vs
7.6 ms at 1 row, 10.9 vs 13.8 at 5, 33.9 vs 37.8 at 64). CUDA keeps cuBLAS.

A decode step's or a verify round's rows (1 to ``SMALL_GEMM_MAX_ROWS``) take kernels.small_gemm instead where
it builds (fp32, AVX2): MKL re-packs the weight on every call of 2+ rows, so 5 rows cost 2-4x one row; the packed
kernel reads it once, and computes a row the same way whatever rows share the call, so a token's logits in a
verify round are bit for bit those of a plain decode step (with the native attention, kernels.attention). It
serves steps that torch runs on one thread (the engine's thread rule runs a small model's steps of up to
SMALL_GEMM_MAX_ROWS rows so), and splits its own calls over the cores (csrc/parallel.c). It costs a second copy of each fp32 CPU weight (DRAFTSMITH_SMALL_GEMM=0
turns it off).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.kernels import native, small_gemm

# Rows up to which the native path (the packed kernel, and the C decoder layer built on it, kernels.layers.native_layer)
# serves a one-thread step. Its calls split over every core (kernels/csrc/parallel.c), so it now beats MKL on 2
# threads at every step measured up to 256 rows: the 20-layer embedded target's whole forward, ms, torch path vs
# native (2-core AVX2 EPYC, fp32, 5 interleaved repetitions): 80 verify rows (batch 16, K=4) 54.1 vs 27.7, 96 rows
# 66.0 vs 34.3, 160 rows 94.0 vs 46.7, 128 decode rows 99.4 vs 62.7, a 256-token prefill 123 vs 77, 256 rows of
# one sequence after 768 cached tokens 158 vs 125. Past that the C attention's row-by-row loop loses to torch's
# batched matmuls on long query blocks: 512 rows of one sequence after 512 cached 288 vs 252, a 1024-token
# prefill 635 vs 402 (the GEMMs alone are even there). The matmuls alone (scripts/bench_small_gemm.py): 1.2-2x
# faster up to 256 rows, even from 512.
SMALL_GEMM_MAX_ROWS = 256


def should_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether oneDNN-packed weights are the fast path for this dtype and device."""
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def stores_transposed(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the plain path keeps the weight as [in, out] row-major (fp32 on CPU, see the module docstring)."""
    return device.type == "cpu" and dtype == torch.float32


class Linear:
    """Inference-only linear over [T, in] rows; a plain object, so a call costs no nn.Module dispatch."""

    def __init__(self, weight: Tensor, bias: Tensor | None, pack: bool | None = None) -> None:
        weight = weight.detach()
        self.bias = None if bias is None else bias.detach()  # [out] or None
        if pack is None:
            pack = should_pack(weight.dtype, weight.device)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1) if pack else None
        # [in, out] contiguous where the plain fp32 CPU path runs it, else None (cuBLAS / oneDNN read `weight`)
        self.weight_t = weight.t().contiguous() if not pack and stores_transposed(weight.dtype, weight.device) else None
        # [out, in]: a view of weight_t where there is one; kept for anything that needs the dense matrix
        self.weight = weight if self.weight_t is None else self.weight_t.t()
        # the few-row kernel beside weight_t (fp32 on CPU); torch.compile traces torch.mm instead (__call__)
        self.small = small_gemm.PackedWeight(weight, self.bias) if self.weight_t is not None and small_gemm.available() else None

    @classmethod
    def fuse(cls, linears: Sequence[nn.Linear], pack: bool | None = None, alias: bool = True) -> "Linear":
        """One matrix for several projections of the same input (q/k/v, gate/up): outputs concatenated.

        alias: the modules' parameters become views of the fused matrix, so fusing a large target does not keep
        two copies of every projection (state_dict and parameters() still read the same values); the serving
        form is final, inference only, and the views are not contiguous. False for a weight shared with
        something else: a head tied to the input embedding then holds its own transposed copy (V x d more
        memory in fp32 on CPU, for the fastest of the step's matmuls), and the embedding stays as it was."""
        if any(getattr(m, "is_quantized", False) for m in linears):  # weight-only int8/int4 (kernels.quant)
            from draftsmith.kernels.quant import fuse_quantized

            return fuse_quantized(linears)
        weights = [m.weight.detach() for m in linears]
        biases = [m.bias for m in linears]
        if any(b is None for b in biases) and not all(b is None for b in biases):
            raise ValueError("fused projections must all have a bias or none")
        bias = None if biases[0] is None else torch.cat([b.detach() for b in biases], dim=0)
        fused = cls(weights[0] if len(weights) == 1 else torch.cat(weights, dim=0), bias, pack)
        # One weight kept as it is already shares the module's storage; anything else is a new matrix.
        if alias and (len(weights) > 1 or fused.weight_t is not None):
            sizes = [w.shape[0] for w in weights]
            with torch.no_grad():
                parts = fused.bias.split(sizes) if fused.bias is not None else [None] * len(sizes)
                for module, w, b in zip(linears, fused.weight.split(sizes), parts):
                    module.weight.data = w
                    if b is not None:
                        module.bias.data = b
        return fused

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    def repack(self, pack: bool) -> None:
        """Switch between the packed and the plain path (torch.compile traces plain matmuls only)."""
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.contiguous(), 1) if pack else None

    def __call__(self, x: Tensor) -> Tensor:
        """x: [..., in] -> [..., out]."""
        if self.packed is None and self.weight_t is None:
            return F.linear(x, self.weight, self.bias)
        if x.dim() != 2:  # oneDNN's packed GEMM and addmm take 2-D input
            return self(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.out_features)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [None], "")
        if self.small is not None and x.shape[0] <= SMALL_GEMM_MAX_ROWS and native.eligible(x):
            return self.small(x)  # single-threaded: a step on several threads keeps MKL's threaded GEMM
        if self.bias is None:
            return torch.mm(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)

    def nbytes(self) -> int:
        """Bytes of weights (and bias) a forward reads."""
        tensors = [self.weight] if self.bias is None else [self.weight, self.bias]
        return sum(t.numel() * t.element_size() for t in tensors)

