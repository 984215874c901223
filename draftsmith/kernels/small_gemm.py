"""x @ W^T for fp32 on an AVX2 CPU with W packed once at load (csrc/small_gemm.c): one read of W per call
whatever the row count, and a row's result independent of the rows beside it. Where the CPU has AVX-512 the same
panels run 512-bit kernels (half the instructions for 7+ rows, the same result bit for bit).

Built and loaded with the other C kernels (kernels.native). Where they cannot run here, or
``DRAFTSMITH_SMALL_GEMM=0``, ``available()`` is False and callers keep torch's matmul.

A draft may keep its panels in fp16 (``panel_storage(torch.float16)`` around building its serving form): a draft
step reads its weights once from memory, so half the bytes make it about half as long, while the arithmetic stays
fp32 (each weight is widened exactly on load). Only the draft's proposals change, by the rounding of its weights;
what the engine emits stays the target's (verification decides), so exactness does not depend on it.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
from collections.abc import Iterator
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
        "small_gemm_f16": ([_P, _L, _L, _L, _P, _L, _P, _P, _L], None),
        "draftsmith_has_f16c": ([], ctypes.c_int),
        "small_gemm_use_avx512": ([ctypes.c_int], None),
        "small_gemm_uses_avx512": ([], ctypes.c_int),
    })


def available() -> bool:
    return _library() is not None


def uses_avx512() -> bool:
    """Whether the kernel runs its AVX-512 form for more than 6 rows (this CPU has AVX-512F and use_avx512 did not
    turn it off): the same panels and, output for output, the same FMA chain as the AVX2 form, so bit for bit its
    results."""
    lib = _library()
    return lib is not None and bool(lib.small_gemm_uses_avx512())


def use_avx512(on: bool) -> None:
    """Pin the AVX2 form (on=False) or allow AVX-512 where the CPU has it (the default), process-wide."""
    lib = _library()
    if lib is not None:
        lib.small_gemm_use_avx512(int(on))


PANEL_DTYPES = (torch.float32, torch.float16)
# what PackedWeights built now store (panel_storage); a context variable, so a draft built in one thread
# cannot leave another thread's target with fp16 panels
_panel_dtype: contextvars.ContextVar[torch.dtype] = contextvars.ContextVar("panel_dtype", default=torch.float32)


@contextlib.contextmanager
def panel_storage(dtype: torch.dtype) -> Iterator[None]:
    """PackedWeights built inside store their panels in ``dtype`` (float32 or float16; float16 falls back to
    float32 on a CPU without F16C). Scoped, as torch's default dtype is, so that a draft's serving form can be
    built in fp16 while the target's, built outside, stays fp32."""
    if dtype not in PANEL_DTYPES:
        raise ValueError(f"panel storage must be one of {PANEL_DTYPES}, got {dtype}")
    lib = _library()
    token = _panel_dtype.set(dtype if dtype == torch.float32 or (lib is not None and lib.draftsmith_has_f16c())
                             else torch.float32)
    try:
        yield
    finally:
        _panel_dtype.reset(token)


class PackedWeight:
    """W [N, K] fp32 on CPU, packed into panels of output columns (csrc/small_gemm.c sizes them) stored in fp32,
    or in fp16 when built inside ``panel_storage(torch.float16)``; call with x [M, K] -> [M, N] (fp32).

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
        packed = torch.empty(lib.small_gemm_packed_floats(self.out_features, self.in_features), dtype=torch.float32)
        lib.small_gemm_pack(dense.data_ptr(), self.out_features, self.in_features, packed.data_ptr())
        # fp16 panels: the fp32 layout element by element (round to nearest), read by small_gemm_f16
        storage = _panel_dtype.get()
        self.packed = packed if storage == torch.float32 else packed.to(storage)
        self.half = self.packed.dtype == torch.float16
        self.bias = None if bias is None else bias.detach().float().contiguous()

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
            lib = _library()
            gemm = lib.small_gemm_f16 if self.half else lib.small_gemm
            gemm(x.data_ptr(), rows, self.in_features, x.stride(0), self.packed.data_ptr(), self.out_features,
                 None if self.bias is None else self.bias.data_ptr(), out.data_ptr(), self.out_features)
        return out
