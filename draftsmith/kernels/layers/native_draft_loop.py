"""A draft's decode steps in one C call (csrc/draft_loop.c, draft_decode_f32).

A standalone draft proposes K tokens in K forwards: one catch-up forward, then K - 1 decode steps of one row per
sequence. Each decode step's arithmetic (a 1-layer draft with fp16 panels: ~0.4 ms on a 2-core AVX2 EPYC) sits in
as much per-step Python (attention metadata, input tensors, embedding, rope, final norm, sampling, token lists).
Nothing between the steps needs Python: the next input is the step's token, the positions and slots follow from
the block tables. So the loop runs in C, over the model's own native stack (the same C layers as its forward), its
embedding, final norm and packed head; EAGLE-1's step input goes through its fc with the carried feature, EAGLE-3's
through its two input norms, and a reduced vocabulary's token through d2t. A proposer can hand the loop its
catch-up too (a first step of several rows per sequence, with each row's feature for EAGLE), so a round of chains is
one C call.

A step's token is the argmax for a greedy sequence (the first of equal maxima, as torch.argmax) and, for a
sequence sampled at a plain temperature (no top-k or top-p filter: LoopSampling), a draw from softmax(logits / T)
by inverting its float64 CDF at one uniform of the request's generator, the rule of kernels.sampling.sample. The
row the draw inverts is returned as the proposal's q, so the verifier's ratio p / q uses the very distribution the
token came from: exactness does not depend on the C exp rounding as torch's does.

It serves what the native layers serve (fp32 on CPU, one thread, every layer native with one shape, paged
caches the C kernels read) plus a tied or untied head packed for the small-row GEMM. Greedy tokens are those of
the Python steps except where two logits tie to within the final norm's rounding (C's 1/sqrtf against torch's
rsqrt); proposals only shape the acceptance, never the output.
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

from draftsmith.kernels import native, native_sampling
from draftsmith.kernels.layers.native_stack import NativeStack
from draftsmith.kernels.layers.rope import RotaryEmbedding
from draftsmith.kernels.sampling import SamplingSettings, uniforms
from draftsmith.kernels.small_gemm import PackedWeight

_P, _L, _F, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_float, ctypes.c_int


class _StackArgs(ctypes.Structure):  # native_stack_t
    _fields_ = [(name, _L) for name in ("d", "num_layers", "inter", "num_heads", "kv_heads", "head_dim",
                                        "num_slots", "block_size")] + [
        ("eps", _F), ("scale", _F), ("weights_f16", _I)] + [
        (name, _P) for name in ("in_norm", "post_norm", "qkv_w", "qkv_b", "o_w", "o_b", "gate_up_w", "gate_up_b",
                                "down_w", "down_b", "k_cache", "v_cache")]


class _EndsArgs(ctypes.Structure):  # draft_ends_t
    _fields_ = [("embed", _P), ("fc", _P), ("fc_bias", _P), ("fc_f16", _I), ("hidden_norm", _P), ("embed_norm", _P),
                ("norm_before_residual", _I), ("input_eps", _F), ("final_norm", _P), ("final_eps", _F),
                ("head", _P), ("head_bias", _P), ("head_f16", _I), ("vocab", _L), ("head_vocab", _L), ("d2t", _P),
                ("cos", _P), ("sin", _P), ("max_positions", _L)]


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    return native.kernel_library("DRAFTSMITH_NATIVE_LAYER", "the native draft loop", {
        "draft_decode_f32": ([_P, _P, _L, _P, _L, _P, _P, _P, _P, _P, _P, _L, _P, _P, _P, _P, _P], _I),
    })


@dataclass(frozen=True)
class Eagle3Inputs:
    """EAGLE-3's step input: the attention reads [embed_norm(embed(token)) ; hidden_norm(feature)] and the residual
    stream starts from the feature (or, with norm_before_residual, its normed form)."""

    embed_norm: Tensor    # [d] fp32
    hidden_norm: Tensor   # [d] fp32
    eps: float
    norm_before_residual: bool

    @classmethod
    def of(cls, embed_norm: Tensor, hidden_norm: Tensor, eps: float, norm_before_residual: bool) -> "Eagle3Inputs":
        return cls(embed_norm.detach().float().contiguous(), hidden_norm.detach().float().contiguous(), float(eps),
                   bool(norm_before_residual))


# The most catch-up rows per sequence a proposer hands the loop: a round's catch-up is at most K + 1 rows; a prompt's,
# first seen, runs as a forward of its own (with the engine's threads for its size).
LOOP_CATCH_UP = 32

# The loop's rope table stops here (a draft config may carry 128k positions: 128 MiB of table at head_dim 128);
# steps past it take the Python path, whose table grows on demand.
MAX_LOOP_POSITIONS = 8192


def loop_rope_table(rotary: RotaryEmbedding) -> tuple[Tensor, Tensor] | None:
    """(cos, signed sin) [n, head_dim] fp32 for positions 0 .. n - 1 (n = the model's positions, at most
    MAX_LOOP_POSITIONS); None for dynamic rope, whose table depends on the sequence length."""
    if rotary.rope_type == "dynamic":
        return None
    length = min(rotary.max_position_embeddings, MAX_LOOP_POSITIONS)
    cos, sin = rotary(torch.arange(length), torch.float32, length - 1)
    return cos.squeeze(1), sin.squeeze(1)


def padded_tables(block_tables: Sequence[Sequence[int]]) -> Tensor:
    """int32 [num_seqs, widest]: each sequence's blocks, -1 past its own (the C loop refuses a step there)."""
    width = max(len(table) for table in block_tables)
    return torch.tensor([list(table) + [-1] * (width - len(table)) for table in block_tables], dtype=torch.int32)


@dataclass(frozen=True)
class LoopSampling:
    """How each sequence of a loop call picks its tokens: 1 / temperature (0: greedy, the argmax) and, for a
    sampled sequence, its generator. The call draws the uniforms up front, once it is sure to run, in the order
    the Python steps draw them (step by step, the sequences of a step in batch order), so requests that share a
    generator get the same values either way."""

    inverse_temperatures: Tensor                  # fp32 [num_seqs], 0 for a greedy sequence
    generators: Sequence[torch.Generator | None]  # [num_seqs]: a sampled sequence's (None: the global RNG)

    @classmethod
    def of(cls, settings: Sequence[SamplingSettings], vocab_size: int,
           generators: Sequence[torch.Generator | None]) -> "LoopSampling | None":
        """None where a sampled sequence filters its distribution (top-k below the vocabulary or top-p below 1:
        kernels.sampling.logits_to_probs is the one place those filters live, so that draft takes the Python steps)
        or the C sampler is switched off (DRAFTSMITH_NATIVE_SAMPLING=0)."""
        if not any(row.temperature > 0 for row in settings):   # all greedy: the loop's argmax needs no sampler
            return cls(torch.zeros(len(settings)), list(generators))
        inverse = native_sampling.inverse_temperatures(settings, vocab_size, greedy_ok=True)
        return None if inverse is None else cls(inverse, list(generators))

    @property
    def greedy(self) -> bool:
        return not bool((self.inverse_temperatures > 0).any())

    def draws(self, num_steps: Sequence[int]) -> Tensor:
        """fp64 [num_seqs, max steps]: each sampled sequence's uniforms, 1.0 past its own (and a greedy one's)."""
        sampled = [float(t) > 0 for t in self.inverse_temperatures]
        drawn = torch.ones(len(sampled), max(num_steps, default=0), dtype=torch.float64)
        for step in range(drawn.shape[1]):
            rows = [j for j, n in enumerate(num_steps) if sampled[j] and n > step]
            if rows:
                drawn[rows, step] = uniforms(1, len(rows), [self.generators[j] for j in rows])[:, 0]
        return drawn


@dataclass(frozen=True)
class LoopTokens:
    """A loop call's result per sequence: its tokens, and for a sampled sequence the rows they were drawn from."""

    tokens: list[list[int]]
    probs: list[Tensor | None]   # fp32 [steps, head rows] per sampled sequence (the draft vocabulary's, with d2t)


@dataclass
class NativeDraftLoop:
    """A model's stack, embedding, final norm, packed head and rope table as the C loop reads them."""

    stack: NativeStack
    embed: Tensor               # [vocab, d] fp32
    final_norm: Tensor | None   # [d] fp32; None: the head reads the stack's output (EAGLE-1's predicted feature)
    final_eps: float
    head: PackedWeight
    cos: Tensor                 # [max_positions, head_dim] fp32, signed sin below
    sin: Tensor
    fc: PackedWeight | None = None   # EAGLE-1: a step's input is fc([embed(token) ; feature]) [d, 2d]
    eagle3: "Eagle3Inputs | None" = None
    d2t: Tensor | None = None        # int64 [head rows]: head row i is token i + d2t[i] (a reduced vocabulary)

    @classmethod
    def build(cls, stack: NativeStack | None, embed: Tensor, final_norm: Tensor | None, final_eps: float,
              head: PackedWeight | None, rope_table: tuple[Tensor, Tensor] | None, fc: PackedWeight | None = None,
              eagle3: "Eagle3Inputs | None" = None, d2t: Tensor | None = None) -> "NativeDraftLoop | None":
        """The loop, or None where the C path cannot serve this model (no native stack or packed head, a dtype
        other than fp32, a head or fc not of the embedding's width, a head of another vocabulary without d2t)."""
        if stack is None or head is None or rope_table is None or _library() is None or embed.dtype != torch.float32:
            return None
        d = embed.shape[1]
        rows = embed.shape[0] if d2t is None else d2t.numel()
        if (d != stack.layers[0].post_norm.shape[0] or (head.in_features, head.out_features) != (d, rows)
                or (final_norm is not None and final_norm.dtype != torch.float32)
                or (fc is not None and (fc.in_features, fc.out_features) != (2 * d, d))
                or (eagle3 is not None and (fc is not None or len(stack.layers) != 1))):
            return None
        cos, sin = (t.detach().float().reshape(t.shape[0], -1).contiguous() for t in rope_table)
        norm = None if final_norm is None else final_norm.detach().contiguous()
        offsets = None if d2t is None else d2t.detach().to(torch.int64).contiguous()
        return cls(stack, embed.detach().contiguous(), norm, float(final_eps), head, cos, sin, fc, eagle3, offsets)

    def accepts(self, layer_caches: Sequence[tuple[Tensor, Tensor]], max_position: int) -> bool:
        """Whether steps up to rope position max_position would run here now: one thread, every layer's caches as
        the C kernels read them (the stack's check, once per placement), the position inside the rope table."""
        return (native.eligible(self.embed) and max_position < self.cos.shape[0]
                and self.stack.caches.served(layer_caches))

    def __call__(self, first_tokens: Sequence[Sequence[int]], start_positions: Sequence[int],
                 num_steps: Sequence[int], block_tables: Tensor, layer_caches: Sequence[tuple[Tensor, Tensor]],
                 scale: float, start_entries: Sequence[int] | None = None, features: Tensor | None = None,
                 sampling: LoopSampling | None = None, first_features: Tensor | None = None) -> LoopTokens:
        """Sequence j feeds first_tokens[j] (the token a chain's step feeds, or the catch-up: every token the draft
        cache lacks) at rope positions from start_positions[j] and decodes num_steps[j] tokens (greedy, or as
        sampling says), the first from its last fed row; its draft KV is written from cache entry start_entries[j]
        on (default: the positions) through its row of block_tables (int32 [num_seqs, width]). features
        [num_seqs, d] fp32 (a draft that carries features: EAGLE's): each sequence's feature, replaced in place by
        the step's predicted one; with a catch-up, first_features [fed rows, d] fp32 holds each fed row's feature
        and features is only written."""
        num_seqs, max_steps = len(first_tokens), max(num_steps, default=0)
        if max_steps <= 0:
            return LoopTokens([[] for _ in first_tokens], [None for _ in first_tokens])
        self._check_features(features, num_seqs)
        fed = [len(tokens) for tokens in first_tokens]
        catch_up = any(n != 1 for n in fed) or first_features is not None
        if catch_up and (min(fed) < 1 or min(num_steps) < 1):
            raise ValueError(f"native draft loop: {fed} first tokens per sequence for {list(num_steps)} steps "
                             "(every sequence feeds one or more and picks)")
        if catch_up and (features is None) != (first_features is None) or first_features is not None and (
                first_features.shape != (sum(fed), self.embed.shape[1]) or first_features.dtype != torch.float32
                or not first_features.is_contiguous()):
            got = None if first_features is None else (first_features.dtype, tuple(first_features.shape))
            raise ValueError(f"native draft loop: a catch-up of {sum(fed)} rows "
                             + (f"takes contiguous fp32 first_features [rows, d], got {got}" if features is not None
                                else "of a draft without features takes no first_features"))
        sampled = sampling is not None and not sampling.greedy
        if sampled and (sampling.inverse_temperatures.shape != (num_seqs,) or len(sampling.generators) != num_seqs):
            raise ValueError(f"native draft loop: sampling for {tuple(sampling.inverse_temperatures.shape)} "
                             f"temperatures and {len(sampling.generators)} generators, asked {num_seqs} sequences")
        draws = sampling.draws(num_steps) if sampled else None
        probs = torch.empty(num_seqs, max_steps, self.head.out_features, dtype=torch.float32) if sampled else None
        out = torch.zeros(num_seqs, max_steps, dtype=torch.int64)
        tables = block_tables.to(torch.int32).contiguous()
        first = torch.tensor([token for tokens in first_tokens for token in tokens], dtype=torch.int64)
        first_cu = torch.tensor([0, *fed], dtype=torch.int32).cumsum(0, dtype=torch.int32) if catch_up else None
        starts = torch.tensor(list(start_positions), dtype=torch.int64)
        entries = starts if start_entries is None else torch.tensor(list(start_entries), dtype=torch.int64)
        steps = torch.tensor(list(num_steps), dtype=torch.int32)
        status = _library().draft_decode_f32(
            ctypes.byref(self._stack_args(layer_caches, scale)), ctypes.byref(self._ends_args()), num_seqs,
            tables.data_ptr(), tables.shape[1], first.data_ptr(), native.address(first_cu),
            native.address(first_features), starts.data_ptr(), entries.data_ptr(),
            steps.data_ptr(), max_steps, native.address(features),
            native.address(sampling.inverse_temperatures if sampled else None), native.address(draws),
            native.address(probs), out.data_ptr())
        if status != 0:
            what = {-2: "a token, position or block outside its table", -3: "no memory for the workspace"}
            raise ValueError(f"native draft loop: {what.get(status, f'status {status}')} (first tokens "
                             f"{list(first_tokens)}, start positions {list(start_positions)}, steps {list(num_steps)}, "
                             f"rope table {self.cos.shape[0]} positions)")
        rows = [None] * num_seqs if probs is None else [
            probs[j, :n] if float(sampling.inverse_temperatures[j]) > 0 else None for j, n in enumerate(num_steps)]
        return LoopTokens([row[:n] for row, n in zip(out.tolist(), num_steps)], rows)

    def _check_features(self, features: Tensor | None, num_seqs: int) -> None:
        carries = self.fc is not None or self.eagle3 is not None
        if carries != (features is not None) or (features is not None and (
                features.shape != (num_seqs, self.embed.shape[1]) or features.dtype != torch.float32
                or not features.is_contiguous())):
            wanted = f"contiguous fp32 features [{num_seqs}, d]" if carries else "no features"
            raise ValueError(f"native draft loop: this draft takes {wanted}, got "
                             f"{None if features is None else (features.dtype, tuple(features.shape))}")

    def _stack_args(self, layer_caches: Sequence[tuple[Tensor, Tensor]], scale: float) -> _StackArgs:
        k_cache = layer_caches[0][0]
        layer, a = self.stack.layers[0], self.stack.addresses
        k_addresses, v_addresses = self.stack.caches.addresses(layer_caches)
        return _StackArgs(layer.post_norm.shape[0], len(self.stack.layers), layer.down.in_features, layer.num_heads,
                          layer.num_kv_heads, layer.head_dim, k_cache.shape[0] * k_cache.shape[1], k_cache.shape[1],
                          layer.eps, scale, int(layer.qkv.half), a["in_norm"].data_ptr(), a["post_norm"].data_ptr(),
                          a["qkv"].data_ptr(), a["qkv_bias"].data_ptr(), a["o_proj"].data_ptr(),
                          a["o_proj_bias"].data_ptr(), a["gate_up"].data_ptr(), a["gate_up_bias"].data_ptr(),
                          a["down"].data_ptr(), a["down_bias"].data_ptr(), k_addresses.data_ptr(),
                          v_addresses.data_ptr())

    def _ends_args(self) -> _EndsArgs:
        fc, e3 = self.fc, self.eagle3
        return _EndsArgs(self.embed.data_ptr(), native.address(None if fc is None else fc.packed),
                         native.address(None if fc is None else fc.bias), int(fc is not None and fc.half),
                         native.address(None if e3 is None else e3.hidden_norm),
                         native.address(None if e3 is None else e3.embed_norm),
                         int(e3 is not None and e3.norm_before_residual), 0.0 if e3 is None else e3.eps,
                         native.address(self.final_norm), self.final_eps, self.head.packed.data_ptr(),
                         native.address(self.head.bias), int(self.head.half), self.embed.shape[0],
                         self.head.out_features,
                         native.address(self.d2t), self.cos.data_ptr(), self.sin.data_ptr(), self.cos.shape[0])


class DraftLoopSlot:
    """A model's draft loop, built on first use (only drafts decode this way) and dropped when its serving form is
    rebuilt: the one cache behind CausalLM's, EagleDraft's and Eagle3Draft's draft_loop()."""

    def __init__(self) -> None:
        self._loop: NativeDraftLoop | None = None
        self._built = False

    def get(self, build: Callable[[], "NativeDraftLoop | None"]) -> "NativeDraftLoop | None":
        if not self._built:
            self._loop, self._built = build(), True
        return self._loop

    def clear(self) -> None:
        self._loop, self._built = None, False
