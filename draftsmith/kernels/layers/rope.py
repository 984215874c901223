"""Rotary position embeddings in every scaling transformers knows, for any per-token positions.

Frequencies come from transformers' own init functions (linear, llama3, yarn, longrope, dynamic, ...), so a
target's rope is reproduced whatever its config says; ``default`` is computed here (no transformers import).
Numerics follow transformers op for op (fp32 frequencies, cos/sin cast to the activation dtype), so fp32
logits match HF to ~1e-6.
"""

from __future__ import annotations

import torch
from torch import Tensor

from draftsmith.kernels.layers.config import DecoderConfig, rope_type


class RotaryEmbedding:
    """cos / signed sin per position, cached as a table per (device, dtype) that grows on demand.

    Static scalings are one table; ``dynamic`` NTK scaling recomputes frequencies for the longest position
    of the current call once it passes max_position_embeddings (the rule transformers applies while one
    sequence grows; a batch of different lengths shares one scaling). A plain object, not an nn.Module:
    nothing here is a parameter or is saved.
    """

    def __init__(self, cfg: DecoderConfig) -> None:
        self.cfg = cfg
        self.head_dim = cfg.head_dim
        self.rope_type = rope_type(cfg.rope_scaling)
        self.max_position_embeddings = cfg.max_position_embeddings
        # Built once: dynamic scaling recomputes frequencies on long batches, and a config costs a millisecond.
        self._hf_config = None if self.rope_type == "default" else cfg.rope_hf_config()
        self.inv_freq, self.attention_scaling = self._frequencies(None)
        if 2 * self.inv_freq.shape[0] != self.head_dim:
            raise ValueError(f"partial rotary embeddings are not supported (rope {cfg.rope_scaling}, "
                             f"head_dim {self.head_dim})")
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[Tensor, Tensor]] = {}

    def _frequencies(self, seq_len: int | None) -> tuple[Tensor, float]:
        """(inv_freq fp32 [head_dim/2] on the CPU, attention scaling of cos/sin).

        Always real CPU tensors, also when the model around it is being built on the meta device."""
        with torch.device("cpu"):
            return self._init_frequencies(seq_len)

    def _init_frequencies(self, seq_len: int | None) -> tuple[Tensor, float]:
        if self.rope_type == "default":
            exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim
            return 1.0 / (self.cfg.rope_theta ** exponents), 1.0
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if self.rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"rope_type {self.rope_type!r} is not supported (transformers knows "
                             f"{sorted(ROPE_INIT_FUNCTIONS)})")
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[self.rope_type](self._hf_config, "cpu", seq_len=seq_len)
        return inv_freq.float(), float(scaling)

    @staticmethod
    def _table(inv_freq: Tensor, length: int, scaling: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Full-width [length, head_dim] cos and *signed* sin (-sin | sin), so rope is one fused expression."""
        freqs = torch.arange(length, device=inv_freq.device, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        cos, sin = (freqs.cos() * scaling).to(dtype), (freqs.sin() * scaling).to(dtype)
        return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)

    def __call__(self, positions: Tensor, dtype: torch.dtype, max_position: int | None = None) -> tuple[Tensor, Tensor]:
        """positions: int [T] -> (cos, signed sin) each [T, 1, head_dim] in ``dtype`` on positions' device.

        ``max_position`` (largest entry of positions) avoids a device sync when the caller knows it.
        """
        if max_position is None:
            max_position = int(positions.max()) if positions.numel() else 0
        device = positions.device
        if self.rope_type == "dynamic" and max_position + 1 > self.max_position_embeddings:
            inv_freq, scaling = self._frequencies(max_position + 1)
            cos, sin = self._table(inv_freq.to(device), max_position + 1, scaling, dtype)
        else:
            cos, sin = self._tables.get((device, dtype), (None, None))
            if cos is None or max_position >= cos.shape[0]:
                length = max(2 * (0 if cos is None else cos.shape[0]), max_position + 1, 256)
                cos, sin = self._table(self.inv_freq.to(device), length, self.attention_scaling, dtype)
                self._tables[(device, dtype)] = (cos, sin)
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [T, heads, head_dim]; cos, signed sin: [T, 1, head_dim]. HF's x*cos + rotate_half(x)*sin, where
    rotate_half(x) = (-x2 | x1) = roll(x, half) * (-1 | 1) and the sign lives in the sin table (3 ops)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)
