"""Shared building blocks of the draft models: RMSNorm, rotary, a Llama decoder layer over flattened tokens.

Every draft runs its transformer layers over a FLATTENED token axis ``[T, d]`` with explicit ``positions [T]``
and a pluggable ``attn_fn(q [T,h,hd], k [T,kv,hd], v [T,kv,hd]) -> [T,h,hd]``. The caller decides what the
tokens attend to:

* training: ``causal_attn_fn(batch, seqlen)`` - plain causal SDPA over a ``[B, S]`` batch flattened to ``B*S``;
* serving: a closure that writes K/V into a paged cache and calls ``kernels.attention`` (the proposer's job);
* tests / simple unrolls: ``DenseKVCache`` - one sequence, contiguous cache, append + causal attend;
* EAGLE "training-time test": ``TTTAttention`` - step 0 attends causally, later steps also see their own
  earlier-step keys on the diagonal, exactly what a serving unroll sees (see ``unroll_ttt``).

The attention scale is always ``head_dim ** -0.5`` (Llama), so closures derive it from ``q.shape[-1]``.
Parameter names follow HF Llama (``self_attn.q_proj``, ``mlp.gate_proj``, ``input_layernorm``...) so weights
map onto standard layouts by prefix only.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

AttnFn = Callable[[Tensor, Tensor, Tensor], Tensor]  # (q [T,h,hd], k [T,kv,hd], v [T,kv,hd]) -> [T,h,hd]


# ----------------------------------------------------------------------------------------------- configs


def hf_config_dict(cfg: Any) -> dict:
    """A target/draft config as a plain dict: accepts a PretrainedConfig, a dict, or a checkpoint dir/file."""
    if isinstance(cfg, dict):
        return dict(cfg)
    if isinstance(cfg, (str, Path)):
        path = Path(cfg)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise ValueError(f"target config: no config.json at {path}")
        return json.loads(path.read_text())
    if hasattr(cfg, "to_dict"):
        return cfg.to_dict()
    raise ValueError(f"target config: expected a PretrainedConfig, dict or path, got {type(cfg).__name__}")


def rope_settings(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either transformers-5 ``rope_parameters`` or the classic fields."""
    params = cfg.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling")
    if params and params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return theta, scaling


@dataclass
class DecoderConfig:
    """Shape of one Llama-family decoder layer (the subset of an HF LlamaConfig a layer needs)."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    qkv_bias: bool = False  # Llama: attention_bias; Qwen2: always True
    o_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"DecoderConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"DecoderConfig: num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.hidden_act != "silu":
            raise ValueError(f"DecoderConfig.hidden_act: only 'silu' is supported, got {self.hidden_act!r}")

    @classmethod
    def from_hf(cls, cfg: Any, **overrides: Any) -> "DecoderConfig":
        d = hf_config_dict(cfg)
        theta, scaling = rope_settings(d)
        heads = int(d["num_attention_heads"])
        qkv_bias = bool(d.get("attention_bias", False)) or d.get("model_type") == "qwen2"
        o_bias = bool(d.get("attention_bias", False))
        fields = dict(
            hidden_size=int(d["hidden_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
            intermediate_size=int(d["intermediate_size"]),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            hidden_act=d.get("hidden_act", "silu"),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
        )
        fields.update(overrides)
        return cls(**fields)

    def to_llama_dict(self) -> dict:
        """The classic HF LlamaConfig fields (rope_theta/rope_scaling spelled the pre-v5 way: every reader knows it)."""
        if self.qkv_bias != self.o_bias:
            raise ValueError("to_llama_dict: Llama has one attention_bias flag; qkv_bias != o_bias cannot be expressed")
        return dict(
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            attention_bias=self.qkv_bias,
            mlp_bias=self.mlp_bias,
            hidden_act=self.hidden_act,
            max_position_embeddings=self.max_position_embeddings,
        )


def decoder_config_from_dict(d: dict) -> DecoderConfig:
    return DecoderConfig(**{k: v for k, v in d.items() if k in DecoderConfig.__dataclass_fields__})


# ------------------------------------------------------------------------------------------------ layers


class RMSNorm(nn.Module):
    """HF-compatible RMSNorm: normalise in fp32, cast back, then scale."""

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> Tensor:
    """Inverse frequencies [head_dim/2] for default, linear and llama3 RoPE (the families our targets use)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"rope_scaling: rope_type {kind!r} is not supported (default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """cos/sin for arbitrary per-token positions; inv_freq is a non-persistent buffer (never saved)."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        # positions [T] -> cos, sin [T, 1, head_dim] (broadcast over heads); fp32 math as HF does.
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, heads, hd] rotated with HF's rotate_half convention."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class LlamaAttention(nn.Module):
    """q/k/v/o projections + rotary; the attention itself is the caller's ``attn_fn``."""

    def __init__(self, cfg: DecoderConfig, input_size: int | None = None) -> None:
        super().__init__()
        in_size = input_size or cfg.hidden_size  # EAGLE-3 feeds [emb ; hidden] (2d) into q/k/v
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(in_size, self.num_heads * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(in_size, self.num_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(in_size, self.num_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    def forward(self, x: Tensor, positions: Tensor, attn_fn: AttnFn) -> Tensor:
        # x [T, in], positions [T] -> [T, d]
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        cos, sin = self.rotary(positions, q.dtype)
        out = attn_fn(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm Llama block over flattened tokens. ``input_norm=False`` drops input_layernorm (EAGLE-1's layer)."""

    def __init__(self, cfg: DecoderConfig, attn_input_size: int | None = None, input_norm: bool = True) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if input_norm else None
        self.self_attn = LlamaAttention(cfg, attn_input_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, hidden: Tensor, positions: Tensor, attn_fn: AttnFn) -> Tensor:
        # hidden [T, d], positions [T] -> [T, d]
        x = self.input_layernorm(hidden) if self.input_layernorm is not None else hidden
        hidden = hidden + self.self_attn(x, positions, attn_fn)
        return self.mlp_block(hidden)

    def mlp_block(self, hidden: Tensor) -> Tensor:
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


def layer_attn(attn_fn: AttnFn | Sequence[AttnFn], layer_idx: int) -> AttnFn:
    """Multi-layer forwards take one attn_fn for all layers (stateless) or one per layer (caches)."""
    if callable(attn_fn):
        return attn_fn
    return attn_fn[layer_idx]


# ------------------------------------------------------------------------------------- attention closures


def _expand_kv(x: Tensor, num_heads: int) -> Tensor:
    # [..., kv, hd] -> [..., h, hd]; kv head g serves query heads g*rep .. (g+1)*rep-1 (HF repeat_kv order)
    rep = num_heads // x.shape[-2]
    return x if rep == 1 else x.repeat_interleave(rep, dim=-2)


def causal_attn_fn(batch: int, seqlen: int) -> AttnFn:
    """Causal SDPA over a [batch, seqlen] batch whose tokens were flattened row-major to T = batch*seqlen."""

    def attn(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        heads, hd = q.shape[1], q.shape[2]
        qb = q.view(batch, seqlen, heads, hd).transpose(1, 2)
        kb = _expand_kv(k.view(batch, seqlen, k.shape[1], hd), heads).transpose(1, 2)
        vb = _expand_kv(v.view(batch, seqlen, v.shape[1], hd), heads).transpose(1, 2)
        out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=hd**-0.5)
        return out.transpose(1, 2).reshape(batch * seqlen, heads, hd)

    return attn


class DenseKVCache:
    """One sequence, contiguous per-layer K/V: append the new tokens, attend causally. For tests and simple unrolls."""

    def __init__(self, num_layers: int) -> None:
        self.keys: list[Tensor | None] = [None] * num_layers
        self.values: list[Tensor | None] = [None] * num_layers

    @property
    def num_tokens(self) -> int:
        return 0 if self.keys[0] is None else int(self.keys[0].shape[0])

    def truncate(self, num_tokens: int) -> None:
        """Roll back to the first num_tokens cached tokens (rejected drafts)."""
        for i in range(len(self.keys)):
            if self.keys[i] is not None:
                self.keys[i] = self.keys[i][:num_tokens]
                self.values[i] = self.values[i][:num_tokens]

    def attn_fns(self) -> list[AttnFn]:
        return [self._layer_fn(i) for i in range(len(self.keys))]

    def _layer_fn(self, layer_idx: int) -> AttnFn:
        def attn(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            if self.keys[layer_idx] is not None:
                k = torch.cat([self.keys[layer_idx], k])
                v = torch.cat([self.values[layer_idx], v])
            self.keys[layer_idx], self.values[layer_idx] = k, v
            num_new, num_ctx, heads, hd = q.shape[0], k.shape[0], q.shape[1], q.shape[2]
            # new token j sits at context index num_ctx - num_new + j and sees indices <= that
            visible = torch.arange(num_ctx, device=q.device)[None, :] <= (
                torch.arange(num_new, device=q.device)[:, None] + num_ctx - num_new
            )
            qh, kh, vh = q.transpose(0, 1), _expand_kv(k, heads).transpose(0, 1), _expand_kv(v, heads).transpose(0, 1)
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=visible, scale=hd**-0.5)
            return out.transpose(0, 1)

        return attn


class TTTAttention:
    """EAGLE "training-time test" attention over a [batch, seqlen] batch unrolled for several steps.

    Step 0 keys are attended causally. A query at index i of step j also sees the keys of steps 1..j at the
    SAME index i (the diagonal) - exactly the keys a serving unroll that started right after index i has
    produced by its j-th draft step. With positions ``arange(S) + j`` at step j (see ``unroll_ttt``) the
    rotary offsets also match serving, so step j at index i equals a serving unroll token for token.
    """

    def __init__(self, batch: int, seqlen: int, num_layers: int) -> None:
        self.batch, self.seqlen = batch, seqlen
        self.keys: list[list[Tensor]] = [[] for _ in range(num_layers)]
        self.values: list[list[Tensor]] = [[] for _ in range(num_layers)]

    def attn_fns(self) -> list[AttnFn]:
        return [self._layer_fn(i) for i in range(len(self.keys))]

    def _layer_fn(self, layer_idx: int) -> AttnFn:
        def attn(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            B, S, heads, hd = self.batch, self.seqlen, q.shape[1], q.shape[2]
            self.keys[layer_idx].append(_expand_kv(k.view(B, S, -1, hd), heads))  # [B,S,h,hd]
            self.values[layer_idx].append(_expand_kv(v.view(B, S, -1, hd), heads))
            qb = q.view(B, S, heads, hd) * hd**-0.5
            k0, v0 = self.keys[layer_idx][0], self.values[layer_idx][0]
            causal = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
            scores0 = torch.einsum("bihd,bjhd->bhij", qb, k0).masked_fill(~causal, float("-inf"))
            diag = [(qb * ks).sum(-1).permute(0, 2, 1)[..., None] for ks in self.keys[layer_idx][1:]]  # [B,h,S,1]
            probs = torch.softmax(torch.cat([scores0, *diag], dim=-1).float(), dim=-1).to(q.dtype)
            out = torch.einsum("bhij,bjhd->bihd", probs[..., :S], v0)
            for step, vs in enumerate(self.values[layer_idx][1:]):
                out = out + probs[..., S + step].permute(0, 2, 1)[..., None] * vs
            return out.reshape(B * S, heads, hd)

        return attn


def unroll_ttt(
    step_fn: Callable[[Tensor, Tensor, Tensor, Any], Tensor],
    input_ids: Tensor,
    hidden_in: Tensor,
    num_steps: int,
    num_layers: int = 1,
    pad_token_id: int = 0,
) -> list[Tensor]:
    """Run an EAGLE draft for num_steps training-time-test steps over a [B, S] batch.

    step_fn(input_ids [T], hidden_in [T,d], positions [T], attn_fn) -> hidden_out [T,d] is the draft's flat forward.
    input_ids [B,S]: input_ids[b, i] is the token paired with feature i (already shifted by one). Step j uses
    the tokens shifted left by j (teacher tokens stand in for the draft's own samples) and the previous step's
    hidden_out as its hidden input. Returns hidden_out [B,S,d] per step; step j at index i predicts the token
    j steps after step 0's target, and indices i >= S - j see padding - mask them in the loss.
    """
    if num_steps < 1:
        raise ValueError(f"unroll_ttt: num_steps must be >= 1, got {num_steps}")
    B, S = input_ids.shape
    cache = TTTAttention(B, S, num_layers)
    fns = cache.attn_fns()
    attn = fns[0] if num_layers == 1 else fns
    outputs: list[Tensor] = []
    ids, hidden = input_ids, hidden_in
    for step in range(num_steps):
        positions = (torch.arange(S, device=input_ids.device) + step).repeat(B)
        hidden = step_fn(ids.reshape(-1), hidden.reshape(B * S, -1), positions, attn).view(B, S, -1)
        outputs.append(hidden)
        ids = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], pad_token_id)], dim=1)
    return outputs


# ------------------------------------------------------------------------------------------------ helpers


def count_parameters(module: nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)


def load_hf_tensors(model_dir: str | Path, names: Sequence[str] | None = None) -> dict[str, Tensor]:
    """Read (some) tensors of an HF safetensors checkpoint dir (single file or sharded with an index)."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no *.safetensors files (only safetensors checkpoints are read)")
    out: dict[str, Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if names is None or key in names:
                    out[key] = f.get_tensor(key)
    return out


def load_target_embed_and_head(model_dir: str | Path) -> tuple[Tensor, Tensor]:
    """(embed_tokens [V,d], lm_head [V,d]) of an HF Llama-family target; tied heads return the embedding twice."""
    tensors = load_hf_tensors(model_dir, ["model.embed_tokens.weight", "lm_head.weight"])
    if "model.embed_tokens.weight" not in tensors:
        raise ValueError(f"{model_dir}: no model.embed_tokens.weight in the checkpoint")
    embed = tensors["model.embed_tokens.weight"]
    return embed, tensors.get("lm_head.weight", embed)

