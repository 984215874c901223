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

import math
from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from draftsmith.kernels.row_ops import topk_rows

GeneratorArg = torch.Generator | Sequence[torch.Generator | None] | None


# Bounds of the values the kernels below accept, as they are used: temperature and top_p in float32,
# top_k and seeds in int64. A positive temperature below MIN_TEMPERATURE divides float32 logits into
# overflow (inf / inf = nan in the softmax); 0 is the way to ask for greedy decoding.
MIN_TEMPERATURE = 1e-4
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def check_sampling_values(temperature: float, top_k: int, top_p: float, seed: int | None = None) -> None:
    """Raise ValueError, naming the field, for any value `logits_to_probs` / `sample` cannot take.

    Checked in the dtype each value is used in, so a value that passes here can never fail inside a
    batch later (1e39 is a finite float64 but inf in float32; 1e-50 is a positive float64 but 0.0).
    """
    temperature32 = float(torch.tensor(float(temperature), dtype=torch.float32))
    if not math.isfinite(temperature32) or temperature32 < 0:
        raise ValueError(f"temperature must be >= 0 and finite in float32 (<= {_FLOAT32_MAX:.3g}), "
                         f"got {temperature!r}")
    if 0 < temperature32 < MIN_TEMPERATURE:
        raise ValueError(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {temperature!r}")
    top_p32 = float(torch.tensor(float(top_p), dtype=torch.float32))
    if not 0.0 < top_p32 <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] in float32, got {top_p!r}")
    if not 0 <= top_k <= INT64_MAX:
        raise ValueError(f"top_k must be in [0, {INT64_MAX}] (0 = off), got {top_k!r}")
    if seed is not None and not INT64_MIN <= seed <= INT64_MAX:
        raise ValueError(f"seed must be in [{INT64_MIN}, {INT64_MAX}], got {seed!r}")


_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


class SamplingSettings(Protocol):
    """A request's sampling settings as the row transforms read them (serve_eval's SamplingParams has them)."""

    temperature: float
    top_k: int
    top_p: float


def is_plain_temperature(temperature: float, top_k: int, top_p: float, vocab_size: int) -> bool:
    """Whether logits_to_probs gives this row softmax(logits / temperature) and nothing else: sampled (T > 0),
    top-k off (0 or >= the vocabulary) and top-p off (1). The C chain verifier and draft loop serve only these rows
    (the C decode sampler takes filtered rows too)."""
    return temperature > 0 and not 0 < top_k < vocab_size and top_p >= 1


def _per_row(value, num_rows: int, name: str, dtype: torch.dtype, device) -> Tensor:
    """Broadcast a scalar / sequence / tensor parameter to a [num_rows] tensor, checking its length."""
    tensor = torch.as_tensor(value, dtype=dtype, device=device)
    if tensor.dim() == 0:
        return tensor.expand(num_rows)
    if tensor.shape != (num_rows,):
        raise ValueError(f"{name} has shape {tuple(tensor.shape)} but logits has {num_rows} rows")
    return tensor


def _checked_params(logits: Tensor, temperature, top_k, top_p) -> tuple[Tensor, Tensor, Tensor]:
    """The three parameters as [N] tensors, refused with their values when out of range."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [N, V], got shape {tuple(logits.shape)}")
    num_rows, device = logits.shape[0], logits.device
    temperature = _per_row(temperature, num_rows, "temperature", torch.float32, device)
    top_k = _per_row(top_k, num_rows, "top_k", torch.int64, device)
    top_p = _per_row(top_p, num_rows, "top_p", torch.float32, device)
    if bool((temperature < 0).any()) or not bool(torch.isfinite(temperature).all()):
        raise ValueError(f"temperature must be finite and >= 0, got {temperature.tolist()}")
    if bool((top_k < 0).any()):
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k.tolist()}")
    if bool(((top_p <= 0) | (top_p > 1)).any()):
        raise ValueError(f"top_p must be in (0, 1], got {top_p.tolist()}")
    return temperature, top_k, top_p


def logits_to_probs(
    logits: Tensor,  # [N, V]
    temperature: Tensor | Sequence[float] | float,  # [N]
    top_k: Tensor | Sequence[int] | int = 0,  # [N], 0 = off
    top_p: Tensor | Sequence[float] | float = 1.0,  # [N], 1 = off
) -> Tensor:  # float32 [N, V]
    """Turn raw logits into the sampling distribution of each row (see module docstring)."""
    temperature, top_k, top_p = _checked_params(logits, temperature, top_k, top_p)
    logits = logits.float()
    greedy = temperature == 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]

    # Greedy rows become one-hot below; filtering them would be wasted work.
    use_top_k = (top_k > 0) & (top_k < logits.shape[1]) & ~greedy
    use_top_p = (top_p < 1) & ~greedy
    candidates = None  # (logits [Rk, W], ids [Rk, W]) of the top-k rows, in id order, -inf outside each row's k
    if bool(use_top_k.any()):
        scaled, candidates = _apply_top_k(scaled, top_k, use_top_k)
    if bool(use_top_p.any()):
        scaled = _apply_top_p(scaled, top_p, use_top_p, use_top_k, candidates)
    probs = scaled.softmax(dim=-1)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def _apply_top_k(scaled: Tensor, top_k: Tensor, use_top_k: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
    """(scaled with -inf outside each filtered row's top k, the rows' candidates or None)."""
    every_k = bool(use_top_k.all())  # the common batch: no row copies in or out
    k_rows = use_top_k.nonzero().squeeze(1)
    k_scaled = scaled if every_k else scaled[k_rows]
    candidates = _top_k_candidates(k_scaled, top_k if every_k else top_k[k_rows])
    if candidates is None:  # a tie runs past the candidate window: settle it by token id over the full row
        return scaled.masked_fill(~_top_k_keep(scaled, top_k, use_top_k), float("-inf")), None
    filtered = torch.full_like(k_scaled, float("-inf")).scatter_(-1, candidates[1], candidates[0])
    if every_k:
        return filtered, candidates
    scaled[k_rows] = filtered
    return scaled, candidates


def _apply_top_p(scaled: Tensor, top_p: Tensor, use_top_p: Tensor, use_top_k: Tensor,
                 candidates: tuple[Tensor, Tensor] | None) -> Tensor:
    """scaled with -inf outside each filtered row's nucleus."""
    vocab_size = scaled.shape[1]
    every_p = bool(use_top_p.all())
    rows = use_top_p.nonzero().squeeze(1)
    if candidates is not None and bool(use_top_k[rows].all()):
        # Only the top-k survivors can be in the nucleus: sort just those.
        if every_p:   # then every row is a top-k row too, in the same order
            cand_logits, cand_ids = candidates
        else:
            at = (use_top_k.cumsum(0) - 1)[rows]  # position of each top-p row among the top-k rows
            cand_logits, cand_ids = candidates[0][at], candidates[1][at]
    else:
        cand_logits = scaled if every_p else scaled[rows]
        cand_ids = torch.arange(vocab_size, device=scaled.device).expand_as(cand_logits)
    nucleus = _top_p_filter(cand_logits, cand_ids, top_p if every_p else top_p[rows], vocab_size)
    if every_p:
        return nucleus
    scaled[rows] = nucleus
    return scaled


# Extra entries _top_k_candidates reads past each row's k-th, so that a tie at the k-th place (common with bf16
# logits, which take only 256 values per octave) is settled inside the window instead of over the full row.
_TIE_WINDOW_MARGIN = 16


def _top_k_candidates(
    scaled: Tensor,  # [R, V], rows that use top-k
    top_k: Tensor,  # int64 [R], each in [1, V)
    temperature: Tensor | None = None,  # [R] > 0: `scaled` is raw logits, to be divided by it
) -> tuple[Tensor, Tensor] | None:  # (logits [R, W], -inf outside each row's top k; ids [R, W])
    """Each row's k highest entries (ties at the k-th value to the lower ids) via one torch.topk (k << V, no sort).

    topk's order among equal values is unspecified, so the kept set is fixed by value and id, not by that order:
    a window of the W highest entries, W a margin past the largest k, holds every entry tied with a row's k-th
    value unless its last entry still equals it; then (rare) this returns None and the caller decides over the
    full row.

    With `temperature`, the window is chosen on the raw logits and only its W entries are divided: x -> x / T is
    non-decreasing, so the raw top W are a top W of the scaled row, and an entry outside the window scales to at
    most the window's last scaled value. The tie test and the kept set then read the scaled values, as they
    would on the scaled row (division can merge two raw values into one scaled value).
    """
    vocab_size = scaled.shape[-1]
    k = top_k[:, None]
    width = min(vocab_size, int(top_k.max()) + _TIE_WINDOW_MARGIN)
    values, ids = topk_rows(scaled, width)  # by value, descending
    if temperature is not None:
        values = values / temperature[:, None]
    kth_value = values.gather(-1, k - 1)  # [R, 1]
    if width < vocab_size and bool((values[:, -1:] == kth_value).any()):
        return None
    # In id order (the top-p filter's stable sort then breaks its ties by id too), the cumulative count takes
    # the lowest tied ids.
    ids, by_id = ids.sort(dim=-1)
    values = values.gather(-1, by_id)
    above = values > kth_value
    tied = values == kth_value
    keep = above | (tied & (tied.cumsum(dim=-1) <= k - above.sum(dim=-1, keepdim=True)))
    return values.masked_fill(~keep, float("-inf")), ids


def _top_k_keep(
    scaled: Tensor,  # [N, V]
    top_k: Tensor,  # int64 [N]
    use_top_k: Tensor,  # bool [N]
) -> Tensor:  # bool [N, V]; all True on rows without top-k
    """The k highest entries of each top-k row, ties at the k-th value going to the lower token ids.

    torch.topk (k << V) finds the k-th value; the set is then fixed by value, not by topk's unspecified
    tie order: everything above it, plus the lowest-id entries equal to it up to k in all.
    """
    k = torch.where(use_top_k, top_k, torch.ones_like(top_k))
    kth_value = topk_rows(scaled, int(k.max()))[0].gather(-1, (k - 1)[:, None])  # [N, 1]
    above = scaled > kth_value
    tied = scaled == kth_value
    num_tied_wanted = k - above.sum(dim=-1)
    keep = above | (tied & (tied.cumsum(dim=-1) <= num_tied_wanted[:, None]))
    return keep | ~use_top_k[:, None]


def _top_p_filter(
    cand_logits: Tensor,  # [R, W] every entry of a row that may be finite (W = V, or its top-k candidates)
    cand_ids: Tensor,  # int64 [R, W] their token ids, ascending along each row
    top_p: Tensor,  # [R]
    vocab_size: int,
) -> Tensor:  # [R, V], -inf outside each row's nucleus
    """The candidates' nucleus (_nucleus) scattered into full rows."""
    out = torch.full((cand_logits.shape[0], vocab_size), float("-inf"), dtype=cand_logits.dtype,
                     device=cand_logits.device)
    return out.scatter_(-1, cand_ids, _nucleus(cand_logits, top_p))


def _nucleus(
    cand_logits: Tensor,  # [R, W] in id order (the full row, or _top_k_candidates' window)
    top_p: Tensor,  # [R]
) -> Tensor:  # [R, W], in the same order, -inf outside each row's nucleus
    """Smallest prefix (by probability, ties by lower id) whose mass reaches top_p; the first is always kept.

    The candidates come in id order, so the stable sort below breaks ties by id.
    """
    sorted_logits, order = cand_logits.sort(dim=-1, descending=True, stable=True)
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = mass_before >= top_p[:, None]
    drop[:, 0] = False
    return cand_logits.masked_fill(torch.empty_like(drop).scatter_(-1, order, drop), float("-inf"))


def sample(
    probs: Tensor,  # [N, V], rows need not be normalized (non-negative, positive sum)
    generators: GeneratorArg = None,  # one per row, a single one for all rows, or None (global RNG)
) -> Tensor:  # int64 [N]
    """Draw one token per row by inverting its CDF at one uniform: the first i with cdf_i > u * sum(p).

    Exact (token i is drawn with probability p_i / sum p; a zero-probability token never: its cdf equals
    its predecessor's), vectorized over rows, and one float64 draw from the row's own generator, so a
    seeded request samples the same tokens whatever else shares its batch. The CDF is float64 whatever
    the probs' dtype. One-hot rows return their argmax. (The exponential race argmax(p / E) needed V draws
    per row: 1.0-1.5 ms for 32 x 4096 on one CPU thread, against ~0.2 ms here.)
    """
    if probs.dim() != 2:
        raise ValueError(f"probs must be 2-D [N, V], got shape {tuple(probs.shape)}")
    if probs.shape[0] == 0:
        return torch.zeros(0, dtype=torch.int64, device=probs.device)
    return _invert_cdf(probs, uniforms(1, probs.shape[0], generators, probs.device))


def _invert_cdf(probs: Tensor, u: Tensor) -> Tensor:  # [N, V], float64 [N, 1] -> int64 [N]
    """The first i of each row with cdf_i > u * sum(p), never a zero-probability entry."""
    vocab_size = probs.shape[1]
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    picked = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1).clamp_(max=vocab_size - 1)
    # Never a zero-probability entry, even where the CDF's sums are not sequential (a parallel cumsum
    # need not repeat the predecessor's value exactly) or the row has no mass at or after the draw.
    off_support = probs.gather(1, picked[:, None]).squeeze(1) <= 0
    if bool(off_support.any()):
        picked[off_support] = _nearest_positive_at_or_before(probs[off_support] > 0, picked[off_support])
    return picked


def sample_logits(
    logits: Tensor,  # [N, V]
    temperature: Tensor | Sequence[float] | float,  # [N]
    top_k: Tensor | Sequence[int] | int = 0,  # [N], 0 = off
    top_p: Tensor | Sequence[float] | float = 1.0,  # [N], 1 = off
    generators: GeneratorArg = None,
) -> Tensor:  # int64 [N]
    """sample(logits_to_probs(logits, temperature, top_k, top_p), generators) without the full rows: the same
    one uniform per row from the same generators, inverted over the same id-ordered CDF, so the same law.

    For plain decoding, where only the token is wanted. Rows with top-k invert their CDF over the k-window's
    candidates (softmax, float64 cumsum and search over W entries, not V: 16 x 4096 rows at top-k 50 / top-p 0.9
    sample in a third of the full-row path's time); the others, and a window whose k-th place ties past its edge,
    take the full-row path.
    """
    temperature, top_k, top_p = _checked_params(logits, temperature, top_k, top_p)
    num_rows, vocab_size = logits.shape
    if num_rows == 0:
        return torch.zeros(0, dtype=torch.int64, device=logits.device)
    u = uniforms(1, num_rows, generators, logits.device)  # [N, 1]: one draw per row, whichever path it takes
    windowed = (top_k > 0) & (top_k < vocab_size) & (temperature > 0)
    if bool(windowed.all()):   # the common batch: no row copies in or out
        tokens = _sample_in_window(logits, temperature, top_k, top_p, u)
        if tokens is not None:
            return tokens
    elif bool(windowed.any()):
        rows, full = windowed.nonzero().squeeze(1), (~windowed).nonzero().squeeze(1)
        drawn = _sample_in_window(logits[rows], temperature[rows], top_k[rows], top_p[rows], u[rows])
        if drawn is not None:
            tokens = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
            tokens[rows] = drawn
            tokens[full] = _invert_cdf(logits_to_probs(logits[full], temperature[full], top_k[full], top_p[full]),
                                       u[full])
            return tokens
    return _invert_cdf(logits_to_probs(logits, temperature, top_k, top_p), u)   # no window, or a tie past one


def _sample_in_window(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor,
                      u: Tensor) -> Tensor | None:  # [R, V], [R] x 3 (T > 0, 0 < k < V), [R, 1] -> [R] or None
    """Each row's token drawn over its top-k window at u (see sample_logits); None if a tie runs past it."""
    candidates = _top_k_candidates(logits.float(), top_k, temperature)
    if candidates is None:
        return None
    cand_logits, cand_ids = candidates  # in id order, -inf outside each row's k
    use_top_p = top_p < 1
    if bool(use_top_p.any()):
        cand_logits = torch.where(use_top_p[:, None], _nucleus(cand_logits, top_p), cand_logits)
    picked = _invert_cdf(cand_logits.softmax(dim=-1), u)
    return cand_ids.gather(-1, picked[:, None]).squeeze(1)


def _nearest_positive_at_or_before(positive: Tensor, index: Tensor) -> Tensor:  # [R, V] bool, [R] -> [R]
    """The last positive entry at or before each row's index; the row's first positive one if none is."""
    vocab_size = positive.shape[1]
    before = positive & (torch.arange(vocab_size, device=positive.device) <= index[:, None])
    last_before = vocab_size - 1 - before.flip(-1).to(torch.int8).argmax(dim=-1)
    return torch.where(before.any(dim=-1), last_before, positive.to(torch.int8).argmax(dim=-1))


def uniforms(
    counts: Sequence[int] | int,  # draws per row (int: same count for all rows)
    num_rows: int,
    generators: GeneratorArg = None,
    device: torch.device | str = "cpu",
    width: int = 0,
) -> Tensor:  # float64 [num_rows, max(max(counts), width)], padding (beyond a row's count) is 1.0
    """float64 uniforms in [0, 1); with per-row generators row i draws exactly counts[i] values.

    Drawing only a row's own count keeps its generator's stream independent of its batch neighbours.
    """
    if isinstance(counts, int):
        counts = [counts] * num_rows
    if len(counts) != num_rows:
        raise ValueError(f"got {len(counts)} counts for {num_rows} rows")
    if width > max(counts, default=0):
        drawn = uniforms(counts, num_rows, generators, device)
        return torch.cat([drawn, torch.ones(num_rows, width - drawn.shape[1], dtype=torch.float64, device=device)], 1)
    width = max(counts, default=0)
    if generators is None or isinstance(generators, torch.Generator):
        draw_device = _draw_device(generators, device)
        return torch.rand((num_rows, width), dtype=torch.float64, device=draw_device, generator=generators).to(device)
    if len(generators) != num_rows:
        raise ValueError(f"got {len(generators)} generators for {num_rows} rows")
    # One draw call per row, then one stack: writing each row into a preallocated tensor costs more than the draw.
    # A None entry draws on `device`, a request's generator on its own device.
    rows = [torch.rand(count, dtype=torch.float64, device=_draw_device(generator, device), generator=generator).to(device)
            for count, generator in zip(counts, generators)]
    if any(count < width for count in counts):
        rows = [torch.cat([row, torch.ones(width - row.shape[0], dtype=torch.float64, device=device)])
                if row.shape[0] < width else row for row in rows]
    if not rows:
        return torch.ones((0, width), dtype=torch.float64, device=device)
    return torch.stack(rows)


def _draw_device(generator: torch.Generator | None, device) -> torch.device:
    """Draw where the generator lives (requests own CPU generators even when the model runs on CUDA)."""
    return torch.device(device) if generator is None else generator.device
