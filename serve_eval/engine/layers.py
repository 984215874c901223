"""Stateless building blocks of the Llama-family forward: RMSNorm and rotary embeddings.

Numerics follow transformers' Llama/Qwen2 modules op for op (norm in fp32 then cast, cos/sin from fp32
frequencies cast to the activation dtype) so fp32 logits match to ~1e-6.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x: [T, d]; weight: [d]. Normalizes in fp32, casts back, then scales (HF order).

    torch's rms_norm without a weight is exactly HF's fp32 x * rsqrt(mean(x^2) + eps) cast back (bit-identical,
    checked for fp32 and bf16) in one call instead of six small ops; the weight multiplies after the cast as in HF.
    """
    return weight * torch.nn.functional.rms_norm(x, (x.shape[-1],), eps=eps)


def rope_parameters(config) -> dict:
    """RoPE settings of a HF config as one dict with at least ``rope_type`` and ``rope_theta``.

    transformers 5.x keeps them in ``config.rope_parameters``; older configs used ``rope_scaling`` plus a
    top-level ``rope_theta``.
    """
    params = getattr(config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    if "rope_type" not in params:
        params["rope_type"] = params.get("type", "default")
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    return params


class RotaryEmbedding:
    """cos/sin per position, cached as a table that grows on demand.

    Supports every rope type transformers knows for static scaling (default, linear, llama3, yarn,
    longrope's short factors below the original length) through its own init functions, and ``dynamic``
    NTK scaling by recomputing frequencies for the longest position of the current batch (the same rule
    transformers applies while one sequence grows; a batch of different lengths shares one scaling).
    """

    def __init__(self, config, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.config = config
        self.params = rope_parameters(config)
        self.rope_type = self.params["rope_type"]
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.max_position_embeddings = int(getattr(config, "max_position_embeddings", 2048))
        self.inv_freq, self.attention_scaling = self._frequencies(None)
        if 2 * self.inv_freq.shape[0] != head_dim:
            raise ValueError(f"partial rotary embeddings are not supported (config {self.params}, head_dim {head_dim})")
        self._cos = torch.empty(0, head_dim, dtype=dtype, device=device)
        self._sin = torch.empty_like(self._cos)

    def _frequencies(self, seq_len: int | None) -> tuple[Tensor, float]:
        if self.rope_type == "default":
            exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim
            return 1.0 / (self.params["rope_theta"] ** exponents).to(self.device), 1.0
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if self.rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"config rope_type {self.rope_type!r} is not supported")
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[self.rope_type](self.config, self.device, seq_len=seq_len)
        return inv_freq.float(), float(scaling)

    @staticmethod
    def _table(inv_freq: Tensor, length: int, scaling: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Full-width [length, head_dim] cos and *signed* sin (-sin | sin), so rope is one fused expression."""
        freqs = torch.arange(length, device=inv_freq.device, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        cos, sin = (freqs.cos() * scaling).to(dtype), (freqs.sin() * scaling).to(dtype)
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)

    def __call__(self, positions: Tensor, max_position: int | None = None) -> tuple[Tensor, Tensor]:
        """positions: int [T] -> (cos, signed sin) each [T, 1, head_dim] in the model dtype.

        ``max_position`` (largest entry of positions) avoids a device sync when the caller knows it.
        """
        if max_position is None:
            max_position = int(positions.max()) if positions.numel() else 0
        if self.rope_type == "dynamic" and max_position + 1 > self.max_position_embeddings:
            inv_freq, scaling = self._frequencies(max_position + 1)
            cos, sin = self._table(inv_freq, max_position + 1, scaling, self.dtype)
        else:
            if max_position >= self._cos.shape[0]:
                length = max(2 * self._cos.shape[0], max_position + 1, 256)
                self._cos, self._sin = self._table(self.inv_freq, length, self.attention_scaling, self.dtype)
            cos, sin = self._cos, self._sin
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [T, heads, head_dim]; cos, signed sin: [T, 1, head_dim]. HF's x*cos + rotate_half(x)*sin, where
    rotate_half(x) = (-x2 | x1) = roll(x, half) * (-1 | 1) and the sign lives in the sin table (3 ops)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


class Linear:
    """y = x @ weight^T + bias, with the weight pre-packed for oneDNN when that is the faster CPU path.

    On CPU, torch's plain bf16 GEMV re-lays out the weight on every call; a weight packed once at load
    runs a batch-1 projection about 1.5-2x faster (measured by scripts/bench_roofline.py). fp32 keeps
    MKL's plain path, which is as fast and is the one the exactness tests pin.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None, pack: bool):
        self.weight = weight  # [out, in], plain; kept for anything that needs the dense matrix
        self.bias = bias
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1) if pack else None

    @staticmethod
    def should_pack(dtype: torch.dtype, device: torch.device) -> bool:
        return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
                and torch.ops.mkldnn._is_mkldnn_bf16_supported())

    def __call__(self, x: Tensor) -> Tensor:
        """x: [T, in] -> [T, out]."""
        if self.packed is None:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [None], "")
