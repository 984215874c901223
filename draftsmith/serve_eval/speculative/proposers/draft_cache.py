"""The paged K/V cache of a draft that keeps its own attention state (EAGLE's layer, the block draft's
layers): blocks from the engine's own KVCacheManager, grown for speculative entries and rolled back
to the accepted ones after verification."""
from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch

from draftsmith.kernels.attention import AttentionMetadata, get_attention_backend, paged_attn_fn, select_backend
from draftsmith.kernels.layers.decoder import AttnFn
from draftsmith.serve_eval.engine.kv_cache_manager import KVCacheManager, cdiv

if TYPE_CHECKING:
    from draftsmith.serve_eval.engine.llm_engine import LLMEngine

_record_ids = itertools.count()
DEFAULT_DRAFT_BLOCKS = 1024  # draft pool without an engine to size it (tests, notebooks)


def draft_pool_blocks(engine: "LLMEngine", block_size: int, rows_per_seq: int) -> int:
    """Blocks of block_size entries for a draft's KV pool sized like the engine's: an entry per target KV token, on
    the device or swapped out (a swapped sequence keeps its draft state, the strategy resets only recomputed ones),
    plus each running sequence's rows beyond its context (its round's speculative rows) and one partly filled block.
    Every draft that keeps a KV pool (standalone, EAGLE, the block draft) sizes it here."""
    tokens = (engine.kv.num_gpu_blocks + engine.config.num_cpu_blocks) * engine.kv.block_size
    return cdiv(tokens, block_size) + engine.config.max_num_seqs * (cdiv(rows_per_seq, block_size) + 1)


class _CacheRecord:
    """The fields of a sequence that KVCacheManager reads (no prefix caching here, so no hashes are kept)."""

    def __init__(self) -> None:
        self.seq_id = next(_record_ids)
        self.num_computed_tokens = 0  # draft cache entries backed by blocks (committed + speculative)
        self.block_hashes: list[int] = []

    @property
    def num_tokens(self) -> int:
        return self.num_computed_tokens


class DraftKVCache:
    """Paged K/V of the one-layer draft: [num_blocks, block_size, num_kv_heads, head_dim] x 2."""

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, attn_backend: str = "auto") -> None:
        self.manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False, watermark=0.0)
        self.block_size = block_size
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.attention = get_attention_backend(select_backend(attn_backend, device, block_size))

    def resize(self, record: _CacheRecord, num_entries: int) -> bool:
        """Back exactly num_entries entries with blocks (roll back or grow); False if the pool is full."""
        if num_entries == record.num_computed_tokens:
            return True
        if num_entries < record.num_computed_tokens:
            self.manager.rollback(record, record.num_computed_tokens - num_entries)
            return True
        if not self.manager.allocate_slots(record, num_entries - record.num_computed_tokens):
            return False
        record.num_computed_tokens = num_entries
        return True

    def free(self, record: _CacheRecord) -> None:
        self.manager.free(record)

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(K, V) cache pairs, one per draft layer that keeps attention state."""
        return [(self.k_cache, self.v_cache)]

    def copy_entries(self, source: _CacheRecord, dest: _CacheRecord, num_entries: int) -> bool:
        """Back `dest` with its own blocks holding `source`'s first num_entries entries (a fork: the
        copies diverge from the next write on); False if the pool is full."""
        if not self.resize(dest, num_entries):
            return False
        if num_entries:
            slots = [self._slots(record, num_entries) for record in (source, dest)]
            for k, v in self.layers():
                for cache in (k, v):
                    flat = cache.view(-1, *cache.shape[2:])
                    flat[slots[1]] = flat[slots[0]]
        return True

    def _slots(self, record: _CacheRecord, num_entries: int) -> torch.Tensor:
        table = torch.tensor(self.block_table(record), dtype=torch.int64, device=self.k_cache.device)
        entries = torch.arange(num_entries, device=self.k_cache.device)
        return table[entries // self.block_size] * self.block_size + entries % self.block_size

    def block_table(self, record: _CacheRecord) -> list[int]:
        return self.manager.get_block_ids(record)

    def attn_fn(self, meta: AttentionMetadata, head_dim: int) -> AttnFn:
        return paged_attn_fn(self.attention, self.k_cache, self.v_cache, meta, head_dim ** -0.5)
