"""The Llama decoder layer over flattened tokens: attention projections + RoPE, SwiGLU MLP, pre-norm residuals.

The math is written once, in ``attend``, ``swiglu`` and ``decoder_block``, over callables (``LayerOps``).
Training passes the nn.Modules themselves (autograd, FSDP/ZeRO hooks fire on each module call); the serving
form (``DecoderLayer.to_serving_``) passes plain objects: one packed q/k/v matrix, one packed gate/up matrix and
functional norms, which cost no nn.Module dispatch in the engine's hot loop.

Parameter names follow HF Llama (``self_attn.q_proj``, ``mlp.gate_proj``, ``input_layernorm``...), so weights
map onto HF checkpoints and standard draft layouts by prefix only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.kernels.layers.config import DecoderConfig
from draftsmith.kernels.layers.family import LayerVariant
from draftsmith.kernels.layers.linear import Linear
from draftsmith.kernels.layers.moe import SparseMoE
from draftsmith.kernels.layers.native_layer import NativeDecoderLayer
from draftsmith.kernels.layers.norm import RMSNorm
from draftsmith.kernels.layers.rope import apply_rope

AttnFn = Callable[[Tensor, Tensor, Tensor], Tensor]  # (q [T,h,hd], k [T,kv,hd], v [T,kv,hd]) -> [T,h,hd]
Op = Callable[[Tensor], Tensor]
# Which of a layer's T rows leave it (a slice or an index tensor): every row's k/v still enters attention,
# but o_proj, the residual and the MLP run on these rows only. None = all rows.
OutRows = slice | Tensor | None


@dataclass(frozen=True)
class HeadShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # Widths in the [T, (H + 2 KVH) * D] projection, stored (not properties): attend reads them every layer.
    q_width: int = field(init=False)
    qk_width: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "q_width", self.num_heads * self.head_dim)
        object.__setattr__(self, "qk_width", (self.num_heads + self.num_kv_heads) * self.head_dim)


def attend(shape: HeadShape, qkv: Op, o_proj: Op, x: Tensor, cos: Tensor, sin: Tensor, attn_fn: AttnFn,
           qk_norm: tuple[Op, Op] | None = None, out_rows: OutRows = None) -> Tensor:
    """x [T, in] -> [T, d] (or [len(out_rows), d]): q/k/v from one [T, (H + 2 KVH) * D] projection, rope on q
    and k heads together.

    qk_norm: Qwen3's per-head RMSNorms of q and of k (over head_dim), applied before rope as in HF."""
    num_tokens = x.shape[0]
    qkv_out = qkv(x)
    if cos.dtype != qkv_out.dtype:  # autocast: projections ran in a lower precision than the rope table
        cos, sin = cos.to(qkv_out.dtype), sin.to(qkv_out.dtype)
    qk = qkv_out[:, :shape.qk_width].view(num_tokens, -1, shape.head_dim)  # [T, H + KVH, D]
    if qk_norm is not None:
        qk = torch.cat([qk_norm[0](qk[:, :shape.num_heads]), qk_norm[1](qk[:, shape.num_heads:])], dim=1)
    qk = apply_rope(qk, cos, sin)
    q, k = qk[:, :shape.num_heads], qk[:, shape.num_heads:]
    v = qkv_out[:, shape.qk_width:].view(num_tokens, shape.num_kv_heads, shape.head_dim)
    out = attn_fn(q, k, v).reshape(num_tokens, shape.q_width)
    return o_proj(out if out_rows is None else out[out_rows])


def swiglu(gate_up: Op, down: Op, x: Tensor) -> Tensor:
    """x [T, d] -> [T, d]: down(silu(gate) * up) with gate | up from one [T, 2 I] projection."""
    gate, up = gate_up(x).chunk(2, dim=-1)
    act = F.silu(gate)
    # In place only without autograd: silu's output is a fresh buffer nobody else reads.
    return down(act.mul_(up) if not torch.is_grad_enabled() else act * up)


class Attention(nn.Module):
    """q/k/v/o projections (HF names) around the caller's ``attn_fn``."""

    def __init__(self, cfg: DecoderConfig, input_size: int | None = None, qk_norm: bool = False) -> None:
        super().__init__()
        in_size = input_size or cfg.hidden_size  # EAGLE-3 feeds [emb ; hidden] (2d) into q/k/v
        self.shape = HeadShape(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        kv_width = cfg.num_key_value_heads * cfg.head_dim
        self.q_proj = nn.Linear(in_size, self.shape.q_width, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(in_size, kv_width, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(in_size, kv_width, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.shape.q_width, cfg.hidden_size, bias=cfg.o_bias)
        if qk_norm:  # Qwen3 (HF names q_norm / k_norm, weight [head_dim])
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.has_qk_norm = qk_norm

    def qkv(self, x: Tensor) -> Tensor:  # [T, in] -> [T, (H + 2 KVH) * D]
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attn_fn: AttnFn, out_rows: OutRows = None) -> Tensor:
        norms = (self.q_norm, self.k_norm) if self.has_qk_norm else None
        return attend(self.shape, self.qkv, self.o_proj, x, cos, sin, attn_fn, norms, out_rows)

    def fused(self, pack: bool | None = None) -> tuple[Linear, Linear]:
        """(q/k/v as one matrix, o_proj) in their serving form."""
        return Linear.fuse([self.q_proj, self.k_proj, self.v_proj], pack), Linear.fuse([self.o_proj], pack)

    def serving(self, pack: bool | None = None,
                fused: tuple[Linear, Linear] | None = None) -> Callable[[Tensor, Tensor, Tensor, AttnFn], Tensor]:
        qkv, o_proj = fused or self.fused(pack)
        norms = (self.q_norm.serving(), self.k_norm.serving()) if self.has_qk_norm else None
        return partial(attend, self.shape, qkv, o_proj, qk_norm=norms)


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def gate_up(self, x: Tensor) -> Tensor:  # [T, d] -> [T, 2 I]
        return torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)

    def forward(self, x: Tensor) -> Tensor:
        return swiglu(self.gate_up, self.down_proj, x)

    def fused(self, pack: bool | None = None) -> tuple[Linear, Linear]:
        """(gate | up as one matrix, down_proj) in their serving form."""
        return Linear.fuse([self.gate_proj, self.up_proj], pack), Linear.fuse([self.down_proj], pack)

    def serving(self, pack: bool | None = None, fused: tuple[Linear, Linear] | None = None) -> Op:
        return partial(swiglu, *(fused or self.fused(pack)))


@dataclass(frozen=True)
class LayerOps:
    """What one decoder layer calls: the modules themselves (training) or their fused serving forms."""

    input_norm: Op | None  # None: EAGLE-1's layer, whose input is the fc output as is
    attention: Callable[[Tensor, Tensor, Tensor, AttnFn], Tensor]
    post_norm: Op
    mlp: Op
    # The whole block in one C call (native_layer), for the calls it accepts; None: no native form.
    native: NativeDecoderLayer | None = None


def mlp_residual(ops: LayerOps, hidden: Tensor) -> Tensor:
    """hidden + mlp(post_norm(hidden)): the second half of every block (EAGLE-3's midlayer too). [T, d]."""
    return hidden + ops.mlp(ops.post_norm(hidden))


def decoder_block(ops: LayerOps, hidden: Tensor, cos: Tensor, sin: Tensor, attn_fn: AttnFn,
                  out_rows: OutRows = None) -> Tensor:
    """Pre-norm Llama block. hidden [T, d] residual stream; cos, sin [T, 1, D] -> [T, d] ([len(out_rows), d]).

    out_rows: a last layer whose other rows nobody reads (the block draft's root and unused masks) skips their
    o_proj and MLP, the bulk of its small-M matmul cost; the kept rows' values are unchanged."""
    if ops.native is not None and out_rows is None and ops.native.reads_hidden and ops.native.accepts(hidden, attn_fn):
        return ops.native(hidden, cos, sin, attn_fn)
    x = hidden if ops.input_norm is None else ops.input_norm(hidden)
    attended = ops.attention(x, cos, sin, attn_fn, out_rows=out_rows)
    return mlp_residual(ops, (hidden if out_rows is None else hidden[out_rows]) + attended)


class DecoderLayer(nn.Module):
    """Pre-norm Llama block over flattened tokens. ``input_norm=False`` drops input_layernorm (EAGLE-1's layer);
    ``variant`` (a target family's layer: q/k norm, routed experts) changes the attention and the MLP."""

    def __init__(self, cfg: DecoderConfig, attn_input_size: int | None = None, input_norm: bool = True,
                 variant: LayerVariant | None = None) -> None:
        super().__init__()
        variant = variant or LayerVariant()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if input_norm else None
        self.self_attn = Attention(cfg, attn_input_size, qk_norm=variant.qk_norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoE(cfg, variant.moe) if variant.moe is not None else MLP(cfg)
        self.serving_ops: LayerOps | None = None  # set by to_serving_(); a plain attribute, not a submodule

    @property
    def ops(self) -> LayerOps:
        if self.serving_ops is not None:
            return self.serving_ops
        return LayerOps(self.input_layernorm, self.self_attn, self.post_attention_layernorm, self.mlp)

    def forward(self, hidden: Tensor, cos: Tensor, sin: Tensor, attn_fn: AttnFn, out_rows: OutRows = None) -> Tensor:
        return decoder_block(self.ops, hidden, cos, sin, attn_fn, out_rows)

    def to_serving_(self, pack: bool | None = None) -> "DecoderLayer":
        """Serving form (inference only): fused, possibly packed projections and functional norms, and the whole
        block in one C call where the layer is a plain Llama block and the native kernels run (native_layer)."""
        norm, post, attn = self.input_layernorm, self.post_attention_layernorm, self.self_attn
        attn_fused = attn.fused(pack)
        mlp_fused = self.mlp.fused(pack) if isinstance(self.mlp, MLP) else None
        mlp = self.mlp.serving(pack) if mlp_fused is None else self.mlp.serving(pack, mlp_fused)
        native = None
        # a wider attention input (EAGLE-3's 2d) is built by the layer's own forward and handed over
        if mlp_fused is not None and not attn.has_qk_norm and (norm is None or norm.eps == post.eps):
            shape = attn.shape
            native = NativeDecoderLayer.build(None if norm is None else norm.weight, post.weight, post.eps,
                                              *attn_fused, *mlp_fused, shape.num_heads, shape.num_kv_heads,
                                              shape.head_dim)
        self.serving_ops = LayerOps(None if norm is None else norm.serving(), attn.serving(pack, attn_fused),
                                    post.serving(), mlp, native)
        return self


def run_layer(layer: nn.Module, *args: Tensor | AttnFn, **kwargs: OutRows) -> Tensor:
    """Call a decoder layer: its serving form straight through forward (no nn.Module dispatch in the hot
    loop), its training form as a module call (autograd and FSDP/ZeRO hooks fire)."""
    if getattr(layer, "serving_ops", None) is not None:
        return layer.forward(*args, **kwargs)
    return layer(*args, **kwargs)
