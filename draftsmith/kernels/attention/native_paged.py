"""Paged attention of short query blocks through the C kernel (csrc/paged_attention.c), the CPU's fp32 fast path.

The torch backend calls it for every sequence with at most ``max_q_len`` new tokens (decode rows, verify
chains and trees, a draft's catch-up) when ``usable``: an activation kernels.native.eligible takes (fp32 CPU,
no autograd), contiguous fp32 caches, a head size that is a multiple of 8, and the native kernels built here
(kernels.native; ``DRAFTSMITH_NATIVE_ATTENTION=0`` turns this one off). It reads the block table in place, so it
needs no gather, no padding and no per-forward plan.

It also takes the steps the engine spreads over several threads (a batch of 64 decode rows): on one thread it
still beats torch's threaded gather-pad-bmm path, which spent ~40% of such a step. Generating 64 answers of the
embedded target (2 cores, fp32, the dataset stage's engine) ran 530-542 tok/s against 380-417 with torch's path.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from draftsmith.kernels import native

if TYPE_CHECKING:  # the package imports this module for write_kv
    from draftsmith.kernels.attention import AttentionMetadata

_P, _L = ctypes.c_void_p, ctypes.c_long


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    return native.kernel_library("DRAFTSMITH_NATIVE_ATTENTION", "the native paged-attention kernel", {
        "paged_attention_f32": ([_P, _L, _L, _L, _P, _P, _P, _L, _P, _P, _L, _P, _L, _L, _L, _L, _L, _L,
                                 ctypes.c_float, _P], ctypes.c_int),
        "paged_kv_write_f32": ([_P, _L, _L, _P, _L, _L, _P, _L, _L, _L, _L, _P, _P], ctypes.c_int),
    })


def available() -> bool:
    return _library() is not None


def caches_served(k_cache: Tensor, v_cache: Tensor) -> bool:
    """Whether the C kernels read and write this layer's paged caches: fp32, CPU, contiguous, of one shape (the
    one check behind usable, can_write and the native layers' accepts)."""
    return (k_cache.shape == v_cache.shape and k_cache.dtype == v_cache.dtype == torch.float32
            and k_cache.device.type == v_cache.device.type == "cpu" and k_cache.is_contiguous()
            and v_cache.is_contiguous())


class LayerCaches:
    """A model's per-layer (k, v) paged caches as its C kernels see them, remembered per placement (an executor's
    or a draft's caches stay where they are, so a step checks and builds nothing; a new allocation at new
    addresses gets its own entry, a few at most):
    - served: every layer's caches of one shape, [blocks, block_size, num_kv_heads, head_dim], each as
      caches_served (~5 us a layer to check);
    - addresses: the int64 arrays of the layers' k and v cache addresses that the C calls take."""

    MAX_PLACEMENTS = 4

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self._served: set[tuple] = set()
        self._addresses: dict[tuple, tuple[Tensor, Tensor]] = {}

    @staticmethod
    def _placement(layer_caches: Sequence[tuple[Tensor, Tensor]]) -> tuple:
        # every layer's addresses, the first layer's layout (served() checks that every layer shares it)
        first_k, first_v = layer_caches[0]
        return (tuple(k.data_ptr() for k, _ in layer_caches), tuple(v.data_ptr() for _, v in layer_caches),
                first_k.shape, first_k.stride(), first_k.dtype, first_k.device,
                first_v.shape, first_v.stride(), first_v.dtype, first_v.device)

    def served(self, layer_caches: Sequence[tuple[Tensor, Tensor]]) -> bool:
        if len(layer_caches) != self.num_layers:
            return False
        placement = self._placement(layer_caches)
        if placement in self._served:
            return True
        first = layer_caches[0][0]
        served = (first.shape[2:] == (self.num_kv_heads, self.head_dim)
                  and all(k.shape == first.shape and caches_served(k, v) for k, v in layer_caches))
        if served:
            if len(self._served) >= self.MAX_PLACEMENTS:
                self._served.clear()
            self._served.add(placement)
        return served

    def addresses(self, layer_caches: Sequence[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        placement = self._placement(layer_caches)
        found = self._addresses.get(placement)
        if found is None:
            if len(self._addresses) >= self.MAX_PLACEMENTS:
                self._addresses.clear()
            found = (native.addresses([k for k, _ in layer_caches]), native.addresses([v for _, v in layer_caches]))
            self._addresses[placement] = found
        return found


def usable(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> bool:
    """Whether attend() serves this layer's call (see the module docstring)."""
    return (native.eligible(q, any_threads=True) and caches_served(k_cache, v_cache)
            and q.shape[-1] % 8 == 0 and _library() is not None)


def can_write(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> bool:
    """Whether write() stores these rows: fp32 CPU rows of the caches' [KVH, D] with unit inner strides,
    contiguous CPU caches, one int64 CPU slot per row (what index_copy_ would check, checked before C copies)."""
    return (native.eligible(k, any_threads=True) and native.eligible(v, any_threads=True) and k.shape == v.shape and k.dim() == 3
            and k.shape[1:] == k_cache.shape[2:] and caches_served(k_cache, v_cache)
            and k.stride(-1) == 1 and v.stride(-1) == 1
            and slot_mapping.dtype == torch.int64 and slot_mapping.device.type == "cpu"
            and slot_mapping.is_contiguous() and slot_mapping.shape == (k.shape[0],) and _library() is not None)


def write(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """write_kv's work in one call: k, v [T, KVH, D] into the caches' slots (see can_write)."""
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    status = _library().paged_kv_write_f32(
        k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1), slot_mapping.data_ptr(),
        k.shape[0], num_slots, k.shape[1], k.shape[2], k_cache.data_ptr(), v_cache.data_ptr())
    if status != 0:
        raise IndexError(f"write_kv: a slot of {slot_mapping.tolist()} is outside the cache's {num_slots} slots")


def _int32(t: Tensor) -> Tensor:
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


def metadata_arrays(meta: "AttentionMetadata", num_tokens: int) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """(block_tables, seq_lens, cu_seqlens_q) as contiguous int32 and the tree mask as contiguous bool (or None):
    the layouts the C side reads."""
    tree = meta.tree_mask
    if tree is not None:
        if tree.shape[0] != num_tokens:
            raise ValueError(f"tree_mask has {tree.shape[0]} rows for {num_tokens} query tokens")
        if tree.dtype != torch.bool or not tree.is_contiguous():
            tree = tree.to(torch.bool).contiguous()
    return _int32(meta.block_tables), _int32(meta.seq_lens), _int32(meta.cu_seqlens_q), tree


def attend(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: "AttentionMetadata", scale: float,
           max_q_len: int) -> tuple[Tensor, int]:
    """q [T, H, D] (rows of a head contiguous); caches [num_blocks, block_size, KVH, D] with the new K/V written.

    Returns ([T, H, D], skipped): the rows of every sequence with at most max_q_len new tokens, and how many
    sequences had more (their rows are left unwritten, for the caller)."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32)
    tables, seq_lens, cu, tree = metadata_arrays(meta, num_tokens)
    status = _library().paged_attention_f32(
        q.data_ptr(), q.stride(0), q.stride(1), num_tokens, k_cache.data_ptr(), v_cache.data_ptr(),
        tables.data_ptr(), tables.shape[1], seq_lens.data_ptr(), cu.data_ptr(), seq_lens.shape[0],
        None if tree is None else tree.data_ptr(), 0 if tree is None else tree.shape[1],
        num_heads, kv_heads, head_dim, block_size, max_q_len, scale, out.data_ptr())
    if status == -1:
        raise MemoryError("native paged attention could not allocate its score buffer")
    if status == -2:
        raise ValueError(f"attention metadata does not hold together for {num_tokens} query tokens: seq_lens "
                         f"{meta.seq_lens.tolist()}, cu_seqlens_q {meta.cu_seqlens_q.tolist()}, block tables of "
                         f"{tables.shape[1]} blocks of {block_size}, tree mask "
                         f"{None if tree is None else tuple(tree.shape)}")
    return out, status
