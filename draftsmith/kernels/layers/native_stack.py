"""A model's whole stack of native decoder layers in one C call (csrc/decoder_layer.c, decoder_stack_f32).

A step through N native layers one Python call at a time pays the dispatch, the checks and ctypes' marshalling of
~35 arguments N times: ~30 us a layer on a small CPU, ~10% of the embedded 20-layer target's decode step and more
of a draft's. The stack pays them once: CausalLM.to_serving_ builds one where every layer has a native form
(native_layer.NativeDecoderLayer) of one shape and weight format, and CausalLM.run hands it the forwards it
``accepts`` (the conditions of a single native layer, for every layer's cache). Layer by layer the arithmetic is
the native layer's, so outputs are bit for bit those of the per-layer path.
"""

from __future__ import annotations

import copy
import ctypes
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import torch
from torch import Tensor

from draftsmith.kernels import native
from draftsmith.kernels.attention import PagedAttention
from draftsmith.kernels.attention.native_paged import LayerCaches
from draftsmith.kernels.layers.native_layer import NativeDecoderLayer, StepInputs, check_status

_P, _L, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_float


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    return native.kernel_library("DRAFTSMITH_NATIVE_LAYER", "the native decoder layer", {
        "decoder_stack_f32": ([_P, _L, _L, _L, _P, _P, _F, ctypes.c_int, _P, _P, _P, _P, _P, _P, _P, _P, _L, _P,
                               _P, _L, _L, _L, _P, _P, _P, _L, _P, _L, _P, _P, _L, _P, _L, _L, _L, _F, _P, _P, _L],
                              ctypes.c_int),
    })


@dataclass(frozen=True)
class NativeStack:
    """Every layer's native form, and the per-layer address arrays the C loop reads (built once: the packed
    weights never move)."""

    layers: tuple[NativeDecoderLayer, ...]
    addresses: dict[str, Tensor]
    caches: LayerCaches = field(compare=False)   # the layers' caches it has checked and their address arrays, per placement

    @classmethod
    def build(cls, layers: Sequence[NativeDecoderLayer | None], min_layers: int = 2,
              reads_hidden: bool = True) -> "NativeStack | None":
        """The stack, or None unless every layer is native with one shape, eps and weight format (and there are
        min_layers or more: for a forward, one layer's own call costs no more; the greedy loop takes one).
        reads_hidden False: EAGLE-3's one layer, whose attention input the greedy loop builds (not callable)."""
        if (len(layers) < min_layers or not layers
                or any(layer is None or layer.reads_hidden != reads_hidden for layer in layers)
                or _library() is None):
            return None
        first = layers[0]

        def signature(layer: NativeDecoderLayer) -> tuple:
            return (layer.eps, layer.qkv.half, layer.num_heads, layer.num_kv_heads, layer.head_dim,
                    layer.down.in_features, layer.post_norm.shape[0])

        if any(signature(layer) != signature(first) for layer in layers):
            return None
        addresses = {
            "in_norm": native.addresses([layer.input_norm for layer in layers]),
            "post_norm": native.addresses([layer.post_norm for layer in layers]),
        }
        for name in ("qkv", "o_proj", "gate_up", "down"):
            packed = [getattr(layer, name) for layer in layers]
            addresses[name] = native.addresses([p.packed for p in packed])
            addresses[name + "_bias"] = native.addresses([p.bias for p in packed])
        addresses["none"] = native.addresses([None] * len(layers))
        return cls(tuple(layers), addresses, LayerCaches(len(layers), first.num_kv_heads, first.head_dim))

    def __deepcopy__(self, memo: dict) -> "NativeStack | None":
        """A copy over copied layers, with its own address arrays (the originals point at the original's
        weights, which may be freed before the copy is)."""
        return NativeStack.build(copy.deepcopy(self.layers, memo), min_layers=1,
                                 reads_hidden=self.layers[0].reads_hidden)

    def accepts(self, hidden: Tensor, attn_fns: Sequence[object]) -> bool:
        """What one native layer accepts, for every layer's attention (one metadata, caches of one shape)."""
        if (len(attn_fns) != len(self.layers) or not self.layers[0].reads_hidden   # (EAGLE-3's: greedy loop only)
                or not self.layers[0].accepts(hidden, attn_fns[0])):
            return False
        first: PagedAttention = attn_fns[0]  # type: ignore[assignment]
        if not all(isinstance(fn, PagedAttention) and fn.meta is first.meta and fn.backend is first.backend
                   and fn.scale == first.scale for fn in attn_fns[1:]):
            return False
        return self.caches.served([(fn.k_cache, fn.v_cache) for fn in attn_fns])

    def __call__(self, hidden: Tensor, cos: Tensor, sin: Tensor, attn_fns: Sequence[PagedAttention],
                 aux_after: Sequence[int] = (), last_rows: Tensor | None = None) -> tuple[Tensor, dict[int, Tensor]]:
        """hidden [T, d] (left as it is) -> (the residual stream after the last layer [T, d], {l: the stream after
        layer l} for l in aux_after); cos, signed sin [T, 1, head_dim]. last_rows: int64 [n], strictly ascending:
        only those rows leave the last layer (its o projection and MLP run on them alone; every row still writes
        its K and V and attends), and the stream returned is theirs, [n, d]."""
        step = StepInputs.of(hidden, cos, sin, attn_fns[0])
        out = step.out
        rows, d = out.shape
        if last_rows is not None:
            last_rows = last_rows.to(torch.int64).contiguous()
            if aux_after and len(self.layers) - 1 in aux_after:
                raise ValueError("native decoder stack: the last layer's aux output is of every row, last_rows keeps "
                                 "some")
        aux = {index: torch.empty(rows, d, dtype=torch.float32) for index in aux_after}
        aux_out = native.addresses([aux.get(index) for index in range(len(self.layers))]) if aux else self.addresses["none"]
        k_caches, v_caches = self.caches.addresses([(fn.k_cache, fn.v_cache) for fn in attn_fns])
        a, layer = self.addresses, self.layers[0]
        status = _library().decoder_stack_f32(
            out.data_ptr(), rows, d, len(self.layers), a["in_norm"].data_ptr(), a["post_norm"].data_ptr(),
            layer.eps, int(layer.qkv.half), a["qkv"].data_ptr(), a["qkv_bias"].data_ptr(), a["o_proj"].data_ptr(),
            a["o_proj_bias"].data_ptr(), a["gate_up"].data_ptr(), a["gate_up_bias"].data_ptr(), a["down"].data_ptr(),
            a["down_bias"].data_ptr(), layer.down.in_features, step.cos.data_ptr(), step.sin.data_ptr(),
            layer.num_heads, layer.num_kv_heads, layer.head_dim, k_caches.data_ptr(), v_caches.data_ptr(),
            *step.attention, aux_out.data_ptr(), native.address(last_rows),
            0 if last_rows is None else last_rows.shape[0])
        check_status(status, attn_fns[0].meta, "native decoder stack")
        return (out if last_rows is None else out[:last_rows.shape[0]]), aux

