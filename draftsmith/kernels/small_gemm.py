"""x @ W^T for fp32 on an AVX2 CPU with W packed once at load (csrc/small_gemm.c): one read of W per call
whatever the row count, and a row's result independent of the rows beside it.

Built and loaded with the other C kernels (kernels.native). Where they cannot run here, or
``DRAFTSMITH_SMALL_GEMM=0``, ``available()`` is False and callers keep torch's matmul.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import torch
from torch import Tensor

from draftsmith.kernels import native

_P, _L = ctypes.c_void_p, ctypes.c_long


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    return native.kernel_library("DRAFTSMITH_SMALL_GEMM", "the small-row GEMM kernel", {
        "small_gemm_packed_floats": ([_L, _L], _L),
        "small_gemm_pack": ([_P, _L, _L, _P], None),
        "small_gemm": ([_P, _L, _L, _L, _P, _L, _P, _P, _L], None),
    })


def available() -> bool:
    return _library() is not None


class PackedWeight:
    """W [N, K] fp32 on CPU, packed into panels of output columns (csrc/small_gemm.c sizes them); call with
    x [M, K] -> [M, N].

    A copy made once: a later in-place change to W (or to the module parameters aliasing it) does not reach
    it, as the serving form it belongs to is final (kernels.layers: inference only, built after loading)."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        lib = _library()
        if lib is None:
            raise RuntimeError("the small-row GEMM kernel is not available here (see small_gemm.available())")
        if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
            raise ValueError(f"PackedWeight takes a 2-D fp32 CPU weight, got {weight.dtype} {tuple(weight.shape)} "
                             f"on {weight.device}")
        self.out_features, self.in_features = (int(s) for s in weight.shape)
        dense = weight.detach().contiguous()
        # the C side sizes its own layout, so the panel width lives in one place
        self.packed = torch.empty(lib.small_gemm_packed_floats(self.out_features, self.in_features), dtype=torch.float32)
        lib.small_gemm_pack(dense.data_ptr(), self.out_features, self.in_features, self.packed.data_ptr())
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self._bias_ptr = None if self.bias is None else self.bias.data_ptr()

    def __call__(self, x: Tensor) -> Tensor:
        """x: [M, K] fp32 CPU -> [M, N]."""
        if x.dim() != 2 or x.shape[1] != self.in_features or x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError(f"PackedWeight [{self.out_features}, {self.in_features}] takes fp32 CPU rows "
                             f"[M, {self.in_features}], got {x.dtype} {tuple(x.shape)} on {x.device}")
        if x.stride(-1) != 1:
            x = x.contiguous()
        rows = x.shape[0]
        out = torch.empty(rows, self.out_features, dtype=torch.float32)
        if rows:  # the library is looked up per call, so the object deep-copies (no ctypes pointer held)
            _library().small_gemm(x.data_ptr(), rows, self.in_features, x.stride(0), self.packed.data_ptr(),
                                  self.out_features, self._bias_ptr, out.data_ptr(), self.out_features)
        return out
