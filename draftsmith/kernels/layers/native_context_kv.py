"""A block draft's context injection in one C call (csrc/decoder_layer.c, context_kv_f32).

Each round the block draft projects the target rows fed since its last round (one or two at batch 1) into every
layer's KV: fc over the aux hidden states, a norm, one projection to every layer's k and v, rope on the k heads,
a cache write per layer. In torch that is ~15 small ops at 3-10 us of dispatch each, a quarter of the round
(scripts/bench_block_cost.py); here it is one call. The projections are the serving Linears' own packed panels, so
the arithmetic is theirs; the norm and the rope are the native decoder layer's.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import torch
from torch import Tensor

from draftsmith.kernels import native
from draftsmith.kernels.attention.native_paged import LayerCaches
from draftsmith.kernels.layers.linear import SMALL_GEMM_MAX_ROWS
from draftsmith.kernels.small_gemm import PackedWeight

_P, _L, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_float


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    return native.kernel_library("DRAFTSMITH_NATIVE_LAYER", "the native decoder layer", {
        "context_kv_f32": ([_P, _L, _L, ctypes.c_int, _P, _P, _L, _P, _F, ctypes.c_int, _P, _P, _L, _L, _L, _P, _P,
                            _P, _P, _P, _L], ctypes.c_int),
    })


@dataclass(frozen=True)
class NativeContextKV:
    """fc [d, A d_t] and the all-layer k/v projection [2 L KVH D, d] as packed panels, the norm between them."""

    fc: PackedWeight
    norm: Tensor  # [d] fp32
    eps: float
    kv: PackedWeight
    num_layers: int
    num_kv_heads: int
    head_dim: int
    caches: LayerCaches = field(compare=False)   # the draft's caches it has checked and their address arrays

    @classmethod
    def build(cls, fc: PackedWeight | None, norm: Tensor, eps: float, kv: PackedWeight | None, num_layers: int,
              num_kv_heads: int, head_dim: int) -> "NativeContextKV | None":
        """The native form, or None where the C kernels or packed panels are missing (torch then runs it)."""
        if (_library() is None or fc is None or kv is None or norm.dtype != torch.float32 or head_dim % 2
                or kv.out_features != 2 * num_layers * num_kv_heads * head_dim or kv.in_features != fc.out_features):
            return None
        return cls(fc, norm.detach().contiguous(), float(eps), kv, num_layers, num_kv_heads, head_dim,
                   LayerCaches(num_layers, num_kv_heads, head_dim))

    def accepts(self, aux: Tensor, caches: Sequence[tuple[Tensor, Tensor]], slots: Tensor) -> bool:
        return (aux.dim() == 2 and 0 < aux.shape[0] <= SMALL_GEMM_MAX_ROWS and native.eligible(aux)
                and aux.shape[1] == self.fc.in_features and slots.shape == (aux.shape[0],)
                and slots.device.type == "cpu" and self.caches.served(caches))

    def __call__(self, aux: Tensor, cos: Tensor, sin: Tensor, caches: Sequence[tuple[Tensor, Tensor]],
                 slots: Tensor) -> None:
        """aux [n, A d_t] fp32; cos, signed sin [n, (1,) head_dim]; caches: each layer's (k, v)
        [blocks, block_size, KVH, D]; slots int64 [n]: the rows' cache slots."""
        aux = aux.contiguous()
        cos, sin = cos.float().reshape(aux.shape[0], -1).contiguous(), sin.float().reshape(aux.shape[0], -1).contiguous()
        slots = slots.to(torch.int64).contiguous()
        k_caches, v_caches = self.caches.addresses(caches)
        first = caches[0][0]
        status = _library().context_kv_f32(
            aux.data_ptr(), aux.shape[0], aux.shape[1], int(self.fc.half), self.fc.packed.data_ptr(),
            native.address(self.fc.bias), self.fc.out_features, self.norm.data_ptr(), self.eps, int(self.kv.half),
            self.kv.packed.data_ptr(), native.address(self.kv.bias), self.num_layers, self.num_kv_heads,
            self.head_dim, cos.data_ptr(), sin.data_ptr(), k_caches.data_ptr(), v_caches.data_ptr(),
            slots.data_ptr(), first.shape[0] * first.shape[1])
        if status != 0:
            what = "no memory for its workspace" if status == -3 else f"a slot outside the cache ({slots.tolist()})"
            raise ValueError(f"native context KV: {what}")
