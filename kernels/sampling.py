"""Logits -> probabilities and sampling with per-request generators.

This module is THE place where temperature, top-k and top-p live. Speculative decoding is only
exact when the target's and the draft's distributions went through the same transform, so both
call `logits_to_probs`; nothing else in the code base re-implements these filters.

Conventions (vectorized over rows, one row per request / per draft position):
- temperature 0 -> one-hot at the argmax of the raw logits (first index on ties);
- top_k 0 (or >= V) -> off; otherwise keep the k highest logits, ties broken by lower token id;
- top_p 1 -> off; otherwise keep the smallest prefix of the (top-k filtered) distribution,
  sorted by probability, whose mass reaches top_p (the first token is always kept).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

GeneratorArg = torch.Generator | Sequence[torch.Generator | None] | None

# Exponential noise is clamped away from 0 so p / noise never divides by zero
# (torch's CPU exponential_ can return exactly 0 with probability ~2^-24 per draw).
_MIN_NOISE = 1e-30


def _per_row(value, num_rows: int, name: str, dtype: torch.dtype, device) -> Tensor:
    """Broadcast a scalar / sequence / tensor parameter to a [num_rows] tensor, checking its length."""
    tensor = torch.as_tensor(value, dtype=dtype, device=device)
    if tensor.dim() == 0:
        return tensor.expand(num_rows)
    if tensor.shape != (num_rows,):
        raise ValueError(f"{name} has shape {tuple(tensor.shape)} but logits has {num_rows} rows")
    return tensor


def logits_to_probs(
    logits: Tensor,  # [N, V]
    temperature: Tensor | Sequence[float] | float,  # [N]
    top_k: Tensor | Sequence[int] | int = 0,  # [N], 0 = off
    top_p: Tensor | Sequence[float] | float = 1.0,  # [N], 1 = off
) -> Tensor:  # float32 [N, V]
    """Turn raw logits into the sampling distribution of each row (see module docstring)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [N, V], got shape {tuple(logits.shape)}")
    num_rows, vocab_size = logits.shape
    device = logits.device
    temperature = _per_row(temperature, num_rows, "temperature", torch.float32, device)
    top_k = _per_row(top_k, num_rows, "top_k", torch.int64, device)
    top_p = _per_row(top_p, num_rows, "top_p", torch.float32, device)
    if bool((temperature < 0).any()) or not bool(torch.isfinite(temperature).all()):
        raise ValueError(f"temperature must be finite and >= 0, got {temperature.tolist()}")
    if bool((top_k < 0).any()):
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k.tolist()}")
    if bool(((top_p <= 0) | (top_p > 1)).any()):
        raise ValueError(f"top_p must be in (0, 1], got {top_p.tolist()}")

    logits = logits.float()
    greedy = temperature == 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]

    use_top_k = (top_k > 0) & (top_k < vocab_size)
    use_top_p = top_p < 1
    if bool((use_top_k | use_top_p).any()):
        # One stable descending sort serves both filters; stability makes tie-breaking by token id.
        sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True, stable=True)
        rank = torch.arange(vocab_size, device=device)
        keep_count = torch.where(use_top_k, top_k, torch.full_like(top_k, vocab_size))
        sorted_logits = sorted_logits.masked_fill(rank[None, :] >= keep_count[:, None], float("-inf"))
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # Only rows that asked for top-p: cumsum rounding must not drop tail tokens when top_p == 1.
        drop = (mass_before >= top_p[:, None]) & use_top_p[:, None]
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled = torch.empty_like(scaled).scatter_(-1, sorted_ids, sorted_logits)

    probs = scaled.softmax(dim=-1)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def _exponential_noise(shape: tuple[int, int], generators: GeneratorArg, dtype, device) -> Tensor:
    """Exp(1) noise [N, V]; row i drawn only from generators[i] so a request's stream is batch-invariant."""
    if generators is None or isinstance(generators, torch.Generator):
        noise = torch.empty(shape, dtype=dtype, device=_draw_device(generators, device))
        noise = noise.exponential_(generator=generators).to(device)
    else:
        if len(generators) != shape[0]:
            raise ValueError(f"got {len(generators)} generators for {shape[0]} rows")
        noise = torch.empty(shape, dtype=dtype, device=device)
        for row, generator in enumerate(generators):
            row_noise = torch.empty(shape[1], dtype=dtype, device=_draw_device(generator, device))
            noise[row] = row_noise.exponential_(generator=generator).to(device)
    return noise.clamp_min_(_MIN_NOISE)


def sample(
    probs: Tensor,  # [N, V], rows need not be normalized (non-negative, positive sum)
    generators: GeneratorArg = None,  # one per row, a single one for all rows, or None (global RNG)
) -> Tensor:  # int64 [N]
    """Draw one token per row: argmax(p / E) with E ~ Exp(1) (the exponential race).

    The race is exact (argmin of independent Exp(rate p_i) picks i with probability p_i / sum p),
    vectorized over rows, and consumes exactly V draws from the row's own generator, so a seeded
    request samples the same tokens whatever else shares its batch. One-hot rows return their argmax.
    float64 probs get float64 noise (used by the verifier's residual distributions).
    """
    if probs.dim() != 2:
        raise ValueError(f"probs must be 2-D [N, V], got shape {tuple(probs.shape)}")
    dtype = torch.float64 if probs.dtype == torch.float64 else torch.float32
    noise = _exponential_noise(tuple(probs.shape), generators, dtype, probs.device)
    return (probs.to(dtype) / noise).argmax(dim=-1)


def uniforms(
    counts: Sequence[int] | int,  # draws per row (int: same count for all rows)
    num_rows: int,
    generators: GeneratorArg = None,
    device: torch.device | str = "cpu",
) -> Tensor:  # float64 [num_rows, max(counts)], padding (beyond a row's count) is 1.0
    """float64 uniforms in [0, 1); with per-row generators row i draws exactly counts[i] values.

    Drawing only a row's own count keeps its generator's stream independent of its batch neighbours.
    """
    if isinstance(counts, int):
        counts = [counts] * num_rows
    if len(counts) != num_rows:
        raise ValueError(f"got {len(counts)} counts for {num_rows} rows")
    width = max(counts, default=0)
    if generators is None or isinstance(generators, torch.Generator):
        draw_device = _draw_device(generators, device)
        return torch.rand((num_rows, width), dtype=torch.float64, device=draw_device, generator=generators).to(device)
    if len(generators) != num_rows:
        raise ValueError(f"got {len(generators)} generators for {num_rows} rows")
    out = torch.ones((num_rows, width), dtype=torch.float64, device=device)
    for row, (count, generator) in enumerate(zip(counts, generators)):
        if count:
            draw_device = _draw_device(generator, device)
            row_draws = torch.rand(count, dtype=torch.float64, device=draw_device, generator=generator)
            out[row, :count] = row_draws.to(device)
    return out


def _draw_device(generator: torch.Generator | None, device) -> torch.device:
    """Draw where the generator lives (requests own CPU generators even when the model runs on CUDA)."""
    return torch.device(device) if generator is None else generator.device
