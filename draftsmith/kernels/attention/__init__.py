"""Paged attention behind one signature, plus backend selection.

Every backend implements ``attention(q, k_cache, v_cache, meta, scale) -> out`` over a paged KV cache
and shares ``write_kv``. The torch backend is the reference (and the CPU default); Triton and
flash-attn are imported lazily so this package imports on a machine without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from draftsmith.kernels.attention import native_paged  # imports nothing of this package at run time

AttentionFn = Callable[[Tensor, Tensor, Tensor, "AttentionMetadata", float], Tensor]

BACKENDS = ("torch", "triton", "flash")

# Batches of up to this many query tokens get their metadata from Python lists, larger ones from vectorised
# tensor ops (AttentionMetadata.for_chunks). One CPU thread, us, lists vs tensors: 1 x 5 tokens (a K=4 round)
# 45 vs 176; 16 x 5 134 vs 207; 32 x 5 227 vs 245; 64 x 1 284 vs 312; 32 x 9 292 vs 250; 64 x 5 406 vs 317.
LIST_METADATA_MAX_TOKENS = 192


@dataclass
class AttentionMetadata:
    """Where the new tokens of a flattened batch come from and where their context lives.

    Query token j (local index) of sequence i sits at position ``seq_lens[i] - q_len_i + j`` and sees
    every context position before ``seq_lens[i] - q_len_i`` plus its own sequence's new tokens that are
    allowed by causality (local <= j) or, when ``tree_mask`` is set, by ``tree_mask[t, local]``.
    """

    cu_seqlens_q: Tensor  # int32 [B+1]; new tokens of seq i are rows cu[i]:cu[i+1]
    seq_lens: Tensor  # int32 [B]; context length of seq i INCLUDING its new tokens
    block_tables: Tensor  # int32 [B, max_blocks_per_seq]; padded with 0, never read past seq_lens
    slot_mapping: Tensor  # int64 [T]; flat slot (block * block_size + offset) of each new token's K/V
    max_seqlen_q: int
    max_seqlen_k: int
    tree_mask: Tensor | None = None  # bool [T, max_seqlen_q]; None = causal
    # Per-forward cache a backend may fill on the first layer's call and reuse in every later layer
    # (the torch backend keeps its decode bucketing plan here). Metadata is built fresh each step and
    # must not be mutated after the first attention call of a forward.
    backend_plan: object | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        num_seqs = self.seq_lens.shape[0]
        if self.cu_seqlens_q.shape[0] != num_seqs + 1:
            raise ValueError(
                f"cu_seqlens_q must have len(seq_lens)+1={num_seqs + 1} entries, got {self.cu_seqlens_q.shape[0]}"
            )
        if self.block_tables.dim() != 2 or self.block_tables.shape[0] != num_seqs:
            raise ValueError(f"block_tables must be [B={num_seqs}, max_blocks], got {tuple(self.block_tables.shape)}")
        if self.tree_mask is not None and self.tree_mask.dim() != 2:
            raise ValueError(f"tree_mask must be [T, max_seqlen_q], got {tuple(self.tree_mask.shape)}")

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def is_pure_decode(self) -> bool:
        """True when every sequence brings exactly one new token and there is no tree mask."""
        return self.max_seqlen_q == 1 and self.tree_mask is None

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        tree_mask: Tensor | None = None,
    ) -> "AttentionMetadata":
        """Build metadata from Python lists (convenience for tests, drafts and simple callers).

        The new tokens of each sequence are its last ``query_lens[i]`` context positions, so their slots
        follow from the block table.
        """
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError("query_lens, seq_lens and block_tables must have one entry per sequence")
        cu = [0]
        slots: list[int] = []
        for q_len, s_len, table in zip(query_lens, seq_lens, block_tables):
            if q_len < 1 or q_len > s_len:
                raise ValueError(f"query_lens entry {q_len} must be in [1, seq_len={s_len}]")
            if len(table) * block_size < s_len:
                raise ValueError(f"block table of {len(table)} blocks cannot hold seq_len={s_len}")
            cu.append(cu[-1] + q_len)
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(s_len - q_len, s_len))
        width = max(1, max(len(t) for t in block_tables))
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        return cls(
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            max_seqlen_q=max(query_lens),
            max_seqlen_k=max(seq_lens),
            tree_mask=tree_mask,
        )


    @classmethod
    def for_chunks(
        cls,
        query_lens: list[int],  # new tokens per sequence
        starts: list[int],  # context positions already in the cache per sequence (the chunk starts there)
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> tuple["AttentionMetadata", Tensor]:  # (metadata, int64 positions [T])
        """The metadata and positions of one step's flattened chunks: from Python lists for a few tokens,
        from one gather over a padded block-table tensor for many (the same values either way)."""
        if sum(query_lens) <= LIST_METADATA_MAX_TOKENS:
            seq_lens = [s + q for s, q in zip(starts, query_lens)]
            positions = [p for s, q in zip(starts, query_lens) for p in range(s, s + q)]
            meta = cls.build(query_lens, seq_lens, block_tables, block_size, device)
            return meta, torch.tensor(positions, dtype=torch.int64, device=device)
        return cls._for_chunks_vectorised(query_lens, starts, block_tables, block_size, device)

    @classmethod
    def _for_chunks_vectorised(cls, query_lens: list[int], starts: list[int], block_tables: list[list[int]],
                               block_size: int, device: torch.device | str) -> tuple["AttentionMetadata", Tensor]:
        width = max(len(t) for t in block_tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32)
        qlens = torch.tensor(query_lens, dtype=torch.int64)
        seq_lens = torch.tensor(starts, dtype=torch.int64) + qlens
        cu = torch.zeros(len(query_lens) + 1, dtype=torch.int64)
        torch.cumsum(qlens, 0, out=cu[1:])
        seq_of_token = torch.repeat_interleave(torch.arange(len(query_lens)), qlens)
        positions = torch.arange(int(cu[-1])) - cu[:-1][seq_of_token] + (seq_lens - qlens)[seq_of_token]
        slots = tables[seq_of_token, positions // block_size].long() * block_size + positions % block_size
        meta = cls(cu_seqlens_q=cu.to(torch.int32).to(device), seq_lens=seq_lens.to(torch.int32).to(device),
                   block_tables=tables.to(device), slot_mapping=slots.to(device),
                   max_seqlen_q=max(query_lens), max_seqlen_k=int(seq_lens.max()))
        return meta, positions.to(device)


def write_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Scatter new K/V rows into their slots.

    k, v: [T, num_kv_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim];
    slot_mapping: int64 [T]. A flat view of the cache makes this one index_copy per tensor; fp32 CPU rows take
    the C kernel's copy instead (one call, not two dispatched ops).
    """
    if native_paged.can_write(k, v, k_cache, v_cache, slot_mapping):
        native_paged.write(k, v, k_cache, v_cache, slot_mapping)
        return
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    k_cache.view(num_slots, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(num_slots, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def select_backend(name: str = "auto", device: torch.device | str | None = None, block_size: int | None = None) -> str:
    """Resolve a backend name. ``auto``: flash on CUDA with flash_attn (and a block size it pages with),
    else triton on CUDA, else torch. Asking for a backend this machine cannot run raises ValueError."""
    if name not in ("auto", *BACKENDS):
        raise ValueError(f"attn_backend must be one of auto/{'/'.join(BACKENDS)}, got {name!r}")
    on_cuda = _cuda_available() and (device is None or torch.device(device).type == "cuda")
    if name == "auto":
        if not on_cuda:
            return "torch"
        from draftsmith.kernels.attention import flash

        if flash.is_available() and (block_size is None or flash.supports_block_size(block_size)):
            return "flash"
        return "triton"
    if name == "flash":
        from draftsmith.kernels.attention import flash

        if not on_cuda:
            raise ValueError("attn_backend='flash' needs a CUDA device; this run has none (use 'torch' or 'auto')")
        if not flash.is_available():
            raise ValueError("attn_backend='flash' needs the flash_attn package, which is not importable here")
    if name == "triton" and not on_cuda and not _triton_interpreted():
        raise ValueError("attn_backend='triton' needs CUDA or TRITON_INTERPRET=1 set before import")
    return name


def _triton_interpreted() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def get_attention_backend(name: str) -> AttentionFn:
    """Return the ``attention`` callable of a concrete backend (``auto`` is resolved first)."""
    name = select_backend(name)
    if name == "torch":
        from draftsmith.kernels.attention.torch_paged import paged_attention

        return paged_attention
    if name == "triton":
        from draftsmith.kernels.attention.triton_paged import paged_attention

        return paged_attention
    from draftsmith.kernels.attention.flash import paged_attention

    return paged_attention


@dataclass(frozen=True)
class PagedAttention:
    """The ``attn_fn`` a kernels.layers forward calls, over one layer's paged cache: write the new tokens' K/V into
    their slots, then attend. q [T,H,D], k/v [T,KVH,D] -> [T,H,D]. The engine's target and the drafts all attend
    through it; a fused layer (kernels.layers.native_layer) reads its cache and metadata to do both itself."""

    backend: AttentionFn
    k_cache: Tensor
    v_cache: Tensor
    meta: AttentionMetadata
    scale: float

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        write_kv(k, v, self.k_cache, self.v_cache, self.meta.slot_mapping)
        return self.backend(q, self.k_cache, self.v_cache, self.meta, self.scale)


def paged_attn_fn(backend: AttentionFn, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata,
                  scale: float) -> PagedAttention:
    return PagedAttention(backend, k_cache, v_cache, meta, scale)


def attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float) -> Tensor:
    """Reference paged attention (torch backend). q: [T, H, D] -> [T, H, D]."""
    from draftsmith.kernels.attention.torch_paged import paged_attention

    return paged_attention(q, k_cache, v_cache, meta, scale)


__all__ = [
    "AttentionMetadata",
    "BACKENDS",
    "PagedAttention",
    "attention",
    "get_attention_backend",
    "paged_attn_fn",
    "select_backend",
    "write_kv",
]
