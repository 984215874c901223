"""A plain Llama decoder layer in one C call (csrc/decoder_layer.c) for a step's few fp32 rows on the CPU.

The serving form of a layer (decoder.DecoderLayer.to_serving_) builds one where the layer is the plain pre-norm
Llama block (no q/k norm, dense SwiGLU MLP, attention input of the hidden width; EAGLE-1's layer without its
input norm too) and the native
kernels run here; ``decoder_block`` then hands it every call it ``accepts``: an activation kernels.native.eligible
takes (fp32 CPU, one thread, no autograd), 1 to SMALL_GEMM_MAX_ROWS rows, all layer outputs wanted, and the
torch backend's paged attention over contiguous fp32 caches (sliding windows, Triton and flash keep the torch
path). ``DRAFTSMITH_NATIVE_LAYER=0`` turns it off. Its projections are the serving Linear's own small_gemm calls,
so a row's result still does not depend on the rows beside it.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

from draftsmith.kernels import native
from draftsmith.kernels.attention import PagedAttention
from draftsmith.kernels.attention.native_paged import caches_served, metadata_arrays
from draftsmith.kernels.attention.torch_paged import paged_attention as torch_paged_attention
from draftsmith.kernels.layers.linear import SMALL_GEMM_MAX_ROWS, Linear
from draftsmith.kernels.small_gemm import PackedWeight

_P, _L, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_float
STATUS = {-1: "no memory for attention scores", -2: "attention metadata that does not hold together",
           -3: "no memory for the layer's workspace", -4: "a KV slot outside the cache",
           -5: "last rows that are not strictly ascending rows of the step"}


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    return native.kernel_library("DRAFTSMITH_NATIVE_LAYER", "the native decoder layer", {
        "decoder_layer_f32": ([_P, _L, _L, _P, _L, _P, _P, _F, ctypes.c_int, _P, _P, _P, _P, _P, _P, _P, _P, _L, _P,
                               _P, _L, _L, _L, _P, _P, _P, _L, _P, _L, _P, _P, _L, _P, _L, _L, _L, _F, _P, _L],
                              ctypes.c_int),
    })


def address(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


@dataclass(frozen=True)
class StepInputs:
    """What the C layer and the C stack both take of one step: a copy of the residual stream (updated in place),
    contiguous fp32 rope rows, and the attention's trailing arguments in the C order (slots, cache size,
    metadata arrays, tree, block size, rows, scale); ``arrays`` keeps the converted metadata alive for the call."""

    out: Tensor
    cos: Tensor
    sin: Tensor
    arrays: tuple[Tensor | None, ...]
    attention: tuple

    @classmethod
    def of(cls, hidden: Tensor, cos: Tensor, sin: Tensor, attn_fn: PagedAttention) -> "StepInputs":
        out = hidden.contiguous().clone()
        meta, k_cache = attn_fn.meta, attn_fn.k_cache
        tables, seq_lens, cu, tree = metadata_arrays(meta, out.shape[0])
        attention = (meta.slot_mapping.data_ptr(), k_cache.shape[0] * k_cache.shape[1], tables.data_ptr(),
                     tables.shape[1], seq_lens.data_ptr(), cu.data_ptr(), seq_lens.shape[0], address(tree),
                     0 if tree is None else tree.shape[1], k_cache.shape[1], out.shape[0], attn_fn.scale)
        return cls(out, cos.float().contiguous(), sin.float().contiguous(), (tables, seq_lens, cu, tree), attention)


def check_status(status: int, meta: object, what: str) -> None:
    """Raise naming the C side's status (STATUS) and the step's sequences, unless it is 0."""
    if status != 0:
        raise ValueError(f"{what}: {STATUS.get(status, f'status {status}')} "
                         f"(seq_lens {meta.seq_lens.tolist()}, slots {meta.slot_mapping.tolist()})")


@dataclass(frozen=True)
class NativeDecoderLayer:
    """What the C layer reads of one serving layer: norm weights and packed projections (fp32 CPU rows; the
    projections' panels all fp32, or all fp16 for a draft's, kernels.small_gemm.panel_storage)."""

    input_norm: Tensor | None  # [d]; None: EAGLE-1's layer, whose input enters attention as it is
    post_norm: Tensor  # [d]
    eps: float
    qkv: PackedWeight
    o_proj: PackedWeight
    gate_up: PackedWeight
    down: PackedWeight
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def build(cls, input_norm: Tensor | None, post_norm: Tensor, eps: float, qkv: object, o_proj: object, gate_up: object,
              down: object, num_heads: int, num_kv_heads: int, head_dim: int) -> "NativeDecoderLayer | None":
        """The layer's native form, or None where it cannot have one (no packed fp32 kernels, odd head size)."""
        linears = (qkv, o_proj, gate_up, down)  # weight-only quantized projections (kernels.quant) keep torch
        packed = [lin.small if isinstance(lin, Linear) else None for lin in linears]
        if (_library() is None or any(p is None for p in packed) or len({p.half for p in packed}) != 1 or head_dim % 8
                or post_norm.dtype != torch.float32
                or (input_norm is not None and input_norm.dtype != torch.float32)):
            return None
        return cls(None if input_norm is None else input_norm.detach().contiguous(), post_norm.detach().contiguous(),
                   float(eps), *packed, num_heads, num_kv_heads, head_dim)

    @property
    def reads_hidden(self) -> bool:
        """Whether the attention's input is the (normed) residual stream; else the caller hands it over
        (EAGLE-3's [norm(embeds) ; norm(hidden)], of the q/k/v projection's input width)."""
        return self.qkv.in_features == self.post_norm.shape[0]

    def accepts(self, hidden: Tensor, attn_fn: object) -> bool:
        return (isinstance(attn_fn, PagedAttention) and attn_fn.backend is torch_paged_attention
                and 0 < hidden.shape[0] <= SMALL_GEMM_MAX_ROWS and native.eligible(hidden)
                and caches_served(attn_fn.k_cache, attn_fn.v_cache)
                and attn_fn.meta.slot_mapping.dtype == torch.int64
                and attn_fn.meta.slot_mapping.shape == (hidden.shape[0],))

    def __call__(self, hidden: Tensor, cos: Tensor, sin: Tensor, attn_fn: PagedAttention,
                 attn_input: Tensor | None = None) -> Tensor:
        """hidden [T, d] -> [T, d] (a new tensor: callers may keep the input, e.g. as an auxiliary hidden state);
        cos, signed sin [T, 1, head_dim]; attn_input [T, qkv in_features]: the attention's input where the layer
        does not read it from hidden (reads_hidden False), hidden then being the residual stream only."""
        if (attn_input is None) != self.reads_hidden:
            raise ValueError(f"native decoder layer: its attention reads {self.qkv.in_features} features, "
                             f"{'from hidden' if self.reads_hidden else 'from attn_input'}; got attn_input "
                             f"{None if attn_input is None else tuple(attn_input.shape)}")
        if attn_input is not None:
            if attn_input.shape != (hidden.shape[0], self.qkv.in_features) or not native.eligible(attn_input):
                raise ValueError(f"native decoder layer: attn_input must be fp32 CPU rows [{hidden.shape[0]}, "
                                 f"{self.qkv.in_features}], got {attn_input.dtype} {tuple(attn_input.shape)}")
            attn_input = attn_input.contiguous()
        step = StepInputs.of(hidden, cos, sin, attn_fn)
        out = step.out
        status = _library().decoder_layer_f32(
            out.data_ptr(), out.shape[0], out.shape[1], address(attn_input),
            0 if attn_input is None else attn_input.shape[1], address(self.input_norm), self.post_norm.data_ptr(),
            self.eps, int(self.qkv.half), self.qkv.packed.data_ptr(), address(self.qkv.bias),
            self.o_proj.packed.data_ptr(), address(self.o_proj.bias), self.gate_up.packed.data_ptr(),
            address(self.gate_up.bias), self.down.packed.data_ptr(), address(self.down.bias), self.down.in_features,
            step.cos.data_ptr(), step.sin.data_ptr(), self.num_heads, self.num_kv_heads, self.head_dim,
            attn_fn.k_cache.data_ptr(), attn_fn.v_cache.data_ptr(), *step.attention, None, 0)   # every row leaves
        check_status(status, attn_fn.meta, "native decoder layer")
        return out
