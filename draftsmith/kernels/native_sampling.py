"""Decode-row sampling and chain verification in C (csrc/sampling.c), for fp32 CPU logits rows.

A decode row sampled at T > 0 needs softmax(logits / T), kernels.sampling's top-k / top-p filters where it has
them, and one inverse-CDF draw; a speculative chain of plain-temperature rows (kernels.sampling.
is_plain_temperature) needs those softmaxes, K accept tests and the stop row's residual. The arithmetic is
microseconds; the torch ops around it (checks, sorts, softmax, float64 cumsum, gathers, searchsorted) cost
~0.3 ms for one decode row and ~0.8 ms for a K=4 chain at batch 1. These functions run the same rules in C with
the same uniforms from the same generators (drawn in the order the torch path draws them), so a seeded request's
stream is unchanged and only fp32 rounding of the softmax differs.

Each returns None where it does not apply (no native library, not fp32 on the CPU, a greedy row, a filtered
chain), and the caller keeps its torch path.
"""
from __future__ import annotations

import ctypes
from collections.abc import Sequence
from functools import lru_cache

import torch
from torch import Tensor

from draftsmith.kernels import native
from draftsmith.kernels.sampling import GeneratorArg, SamplingSettings, is_plain_temperature, uniforms

_P, _L = ctypes.c_void_p, ctypes.c_long


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    return native.kernel_library("DRAFTSMITH_NATIVE_SAMPLING", "the native sampler", {
        "sample_filtered_rows_f32": ([_P, _L, _L, _P, _P, _P, _P, _P, _P, _P, _P], None),
        "verify_chains_f32": ([_P, _L, _L, _L, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P], ctypes.c_int),
    })


def inverse_temperatures(settings: Sequence[SamplingSettings], vocab_size: int,
                         greedy_ok: bool = False) -> Tensor | None:
    """fp32 [N] 1 / T per row (0 for a greedy row, where greedy_ok), or None unless the C sampler is on here and
    every row is sampled at a plain temperature (or greedy, where greedy_ok)."""
    if _library() is None:
        return None
    inverse = []
    for row in settings:
        if greedy_ok and row.temperature == 0:
            inverse.append(0.0)
        elif is_plain_temperature(row.temperature, row.top_k, row.top_p, vocab_size):
            inverse.append(1.0 / row.temperature)
        else:
            return None
    return torch.tensor(inverse, dtype=torch.float32)


def _served(logits: Tensor, settings: Sequence[SamplingSettings]) -> Tensor | None:
    """1 / T per row where every row is plain-temperature sampling of fp32 CPU logits here, else None."""
    if logits.dtype != torch.float32 or logits.device.type != "cpu":
        return None
    return inverse_temperatures(settings, logits.shape[-1])


_RANKED_BYTES = 16   # csrc/sampling.c's ranked_t: a float value and an int64 id


def sample_rows(logits: Tensor, settings: Sequence[SamplingSettings], generators: GeneratorArg) -> Tensor | None:
    """int64 [N]: sample_logits' draw for each row of logits [N, V] sampled at T > 0, plain or filtered by top-k /
    top-p (kernels.sampling's filters on the same scaled values, one uniform of the row's generator). None where
    this path does not apply (no native library, not fp32 on the CPU, a greedy row)."""
    if _library() is None or logits.dtype != torch.float32 or logits.device.type != "cpu":
        return None
    if any(row.temperature <= 0 for row in settings):
        return None
    num_rows, vocab = logits.shape
    temperature = torch.tensor([row.temperature for row in settings], dtype=torch.float32)
    inverse = torch.tensor([1.0 / row.temperature for row in settings], dtype=torch.float32)
    top_k = torch.tensor([row.top_k if row.top_k < vocab else 0 for row in settings], dtype=torch.int64)
    top_p = torch.tensor([row.top_p for row in settings], dtype=torch.float32)
    rows = logits.contiguous()
    u = uniforms(1, num_rows, generators).contiguous()
    out = torch.empty(num_rows, dtype=torch.int64)
    work = torch.empty(2 * vocab, dtype=torch.float32)
    ranked = torch.empty(vocab * _RANKED_BYTES, dtype=torch.uint8)
    _library().sample_filtered_rows_f32(rows.data_ptr(), num_rows, vocab, temperature.data_ptr(), inverse.data_ptr(),
                                        top_k.data_ptr(), top_p.data_ptr(), u.data_ptr(), work.data_ptr(),
                                        ranked.data_ptr(), out.data_ptr())
    return out


def verify_plain_chains(
    logits: Tensor,                  # fp32 [R, V]: each chain's root row at root_rows[b], its nodes' rows after it
    root_rows: Sequence[int],        # [B]
    tokens: Tensor,                  # int64 [B, K] (padded past num_nodes)
    num_nodes: Sequence[int],        # [B]
    draft_probs: Tensor | None,      # [B, K, V] the rows the drafts were drawn from; None: point masses
    point_mass: Tensor | None,       # bool [B, K]: a point-mass draft among dense rows
    settings: Sequence[SamplingSettings],       # [B]
    generators: Sequence[torch.Generator | None],
) -> tuple[Tensor, Tensor] | None:
    """verify_fast.sampled_chain_accept on the logits (the target rows' softmax(logits / T) computed in C, only
    those the tests reach): (tokens [B, K+1]: the accepted drafts, the final token, then -1; num_accepted [B]).
    The uniforms are each chain's num_nodes accept tests then its final draw, from its generator, in the torch
    path's order. None where this path does not apply."""
    inverse = _served(logits, settings)
    if inverse is None or (draft_probs is not None and draft_probs.dtype != torch.float32):
        return None
    batch, width = tokens.shape
    _check_chains(logits, root_rows, tokens, num_nodes, draft_probs, point_mass)
    # sampled_chain_accept's order: every chain's accept tests, then every chain's final draw
    nodes = torch.tensor(list(num_nodes), dtype=torch.int64)
    u = uniforms(list(num_nodes), batch, list(generators), width=width + 1)
    u[torch.arange(batch), nodes] = uniforms(1, batch, list(generators))[:, 0]
    rows, vocab = logits.contiguous(), logits.shape[1]
    chains = tokens.to(torch.int64).contiguous()
    dense = None if draft_probs is None else draft_probs.contiguous()
    points = None if point_mass is None or dense is None else point_mass.to(torch.uint8).contiguous()
    roots = torch.tensor(list(root_rows), dtype=torch.int64)
    work, residual = torch.empty(vocab, dtype=torch.float32), torch.empty(vocab, dtype=torch.float64)
    out = torch.empty(batch, width + 1, dtype=torch.int64)
    num_accepted = torch.empty(batch, dtype=torch.int64)
    status = _library().verify_chains_f32(
        rows.data_ptr(), vocab, batch, width, roots.data_ptr(), chains.data_ptr(), nodes.data_ptr(),
        native.address(dense), native.address(points), inverse.data_ptr(), u.contiguous().data_ptr(), work.data_ptr(),
        residual.data_ptr(),
        out.data_ptr(), num_accepted.data_ptr())
    if status != 0:
        raise ValueError(f"verify_plain_chains: a draft token outside the vocabulary of {vocab} ({tokens.tolist()})")
    return out, num_accepted


def _check_chains(logits: Tensor, root_rows: Sequence[int], tokens: Tensor, num_nodes: Sequence[int],
                  draft_probs: Tensor | None, point_mass: Tensor | None) -> None:
    """The shapes the C verifier reads through raw pointers, refused with the mismatch (never read out of bounds)."""
    batch, width = tokens.shape
    rows, vocab = logits.shape
    problems = []
    if len(root_rows) != batch or len(num_nodes) != batch:
        problems.append(f"{len(root_rows)} roots and {len(num_nodes)} node counts for {batch} chains")
    elif any(not 0 <= n <= width or r < 0 or r + n >= rows for r, n in zip(root_rows, num_nodes)):
        problems.append(f"roots {list(root_rows)} with {list(num_nodes)} nodes outside {rows} logits rows or "
                        f"width {width}")
    if draft_probs is not None and (tuple(draft_probs.shape) != (batch, width, vocab)
                                    or draft_probs.device.type != "cpu"):
        problems.append(f"draft rows {tuple(draft_probs.shape)} on {draft_probs.device}, not [{batch}, {width}, "
                        f"{vocab}] on the CPU")
    if point_mass is not None and tuple(point_mass.shape) != (batch, width):
        problems.append(f"point_mass {tuple(point_mass.shape)}, not [{batch}, {width}]")
    if tokens.device.type != "cpu":
        problems.append(f"tokens on {tokens.device}")
    if problems:
        raise ValueError("verify_plain_chains: " + "; ".join(problems))
