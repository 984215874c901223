"""What a feature-fed draft with a KV cache of its own keeps per request, and the calls that keep it.

EAGLE-1, EAGLE-3 and the block draft all take the target's features of accepted positions (add_features,
consecutive positions), hold them as pending rows until their next propose turns them into committed entries
of the draft's paged KV cache, drop the speculative entries a round wrote (on_accepted), and free or fork a
request's entries (reset, fork). One definition of that bookkeeping; each kind says which feature it reads
(``feature_name``, ``feature_width``), how its cache is built (``_allocate``) and how many draft entries a
running sequence holds beyond its context (``_draft_rows_per_seq``).

A cache index is ``position - base_pos``, base_pos being the first fed position (after a prefix-cache hit the
target never computed features for the cached prefix; the draft then starts after it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from draftsmith.serve_eval.engine.threads import ThreadChoice
from draftsmith.serve_eval.speculative.proposers.base import FeatureBatch, Proposer, TargetFeatures
from draftsmith.serve_eval.speculative.proposers.draft_cache import (
    DEFAULT_DRAFT_BLOCKS,
    DraftKVCache,
    _CacheRecord,
    draft_pool_blocks,
)
from draftsmith.serve_eval.speculative.proposers.features import check_feature_rows, check_feature_start
from draftsmith.serve_eval.speculative.verify import VerifyResult


@dataclass
class FeatureState:
    """One request's draft cache record and the fed rows not yet in it."""

    record: _CacheRecord = field(default_factory=_CacheRecord)
    base_pos: int | None = None  # position of draft cache index 0 (the first fed feature)
    num_committed: int = 0  # cache entries holding true (target feature, next token) pairs
    pending: list[Tensor] = field(default_factory=list)  # fed rows not yet committed, in position order
    num_pending: int = 0

    @property
    def next_pos(self) -> int:  # the position the next fed row must have
        return (self.base_pos or 0) + self.num_committed + self.num_pending

    def fork(self, cache: DraftKVCache) -> "FeatureState":
        """A forked sample's own copy (parallel sampling): the committed entries pair prompt features with
        prompt tokens, which the samples share; the rows still pending pair with each sample's own tokens."""
        child = FeatureState(base_pos=self.base_pos, num_committed=self.num_committed,
                             pending=list(self.pending), num_pending=self.num_pending)
        if not cache.copy_entries(self.record, child.record, self.num_committed):
            raise RuntimeError("draft KV cache is full: cannot fork a sample's draft state")
        return child


class FeatureCacheProposer(Proposer):
    """The per-request bookkeeping of a feature-fed draft with its own KV cache (module docstring)."""

    needs_hidden = True
    feature_name = "hidden"   # the TargetFeatures / FeatureBatch field it reads: "hidden" or "aux"
    cache: DraftKVCache | None
    _states: dict[str, FeatureState]

    def _init_cache_state(self, weight: Tensor, num_blocks: int | None, block_size: int, attn_backend: str) -> None:
        """The draft's device and dtype (its weights'), no requests, and its cache: allocated now with num_blocks,
        else sized by attach(engine) (or DEFAULT_DRAFT_BLOCKS at the first feature without an engine)."""
        self.device, self.dtype = weight.device, weight.dtype
        self.block_size, self.attn_backend = block_size, attn_backend
        self.threads: ThreadChoice | None = None   # the engine's thread rule, for a long catch-up (attach)
        self._states = {}
        self.cache = None
        if num_blocks is not None:
            self._allocate(num_blocks)

    def attach(self, engine: Any) -> None:
        """Size the draft pool like the engine's (draft_cache.draft_pool_blocks)."""
        self.threads = engine.threads
        if self.cache is None:
            self._allocate(draft_pool_blocks(engine, self.block_size, self._draft_rows_per_seq(engine)))

    def _draft_rows_per_seq(self, engine: Any) -> int:
        """Draft cache entries a running sequence may hold beyond its context (its round's speculative rows)."""
        raise NotImplementedError

    @property
    def feature_width(self) -> int:
        raise NotImplementedError

    def _feature_rows(self, feats: TargetFeatures | FeatureBatch) -> Tensor | None:
        return getattr(feats, self.feature_name)   # both name the fields alike

    def _allocate(self, num_blocks: int) -> None:
        raise NotImplementedError

    def _ensure_cache(self) -> DraftKVCache:
        if self.cache is None:
            self._allocate(DEFAULT_DRAFT_BLOCKS)
        return self.cache

    def add_features(self, request_id: str, feats: TargetFeatures) -> None:
        rows = self._feature_rows(feats)
        check_feature_rows(rows, f"request {request_id}: TargetFeatures", self.feature_width, self.feature_name)
        # a copy: the caller keeps its tensor
        self._append(request_id, feats.start_pos, rows.detach().to(self.device, self.dtype, copy=True))

    def add_feature_batch(self, batch: FeatureBatch) -> None:
        """The batch's rows checked and moved once. A request keeps a view of its rows (the batch is ours) where
        they are at least an even share of the batch (a decode step's one row each; a prefill chunk), else a copy:
        a decoding request's row must not hold a step's prefill chunks alive until its next propose."""
        rows = self._feature_rows(batch)
        check_feature_rows(rows, "FeatureBatch", self.feature_width, self.feature_name)
        if not len(batch.request_ids) == len(batch.start_positions) == len(batch.counts) or sum(batch.counts) != rows.shape[0]:
            raise ValueError(f"FeatureBatch: {len(batch.request_ids)} request ids, {len(batch.start_positions)} start "
                             f"positions and {len(batch.counts)} counts (sum {sum(batch.counts)}) for {rows.shape[0]} rows")
        rows = rows.detach().to(self.device, self.dtype)
        even_share = rows.shape[0] / max(1, len(batch.counts))
        for request_id, start_pos, own in zip(batch.request_ids, batch.start_positions, rows.split(batch.counts)):
            self._append(request_id, start_pos, own if own.shape[0] >= even_share else own.clone())

    def _append(self, request_id: str, start_pos: int, rows: Tensor) -> None:
        """Checked rows [n, width] of consecutive positions from start_pos become the request's pending rows."""
        self._ensure_cache()
        state = self._states.setdefault(request_id, FeatureState())
        started = state.base_pos is not None
        check_feature_start(start_pos, state.next_pos if started else None, request_id)
        if not rows.shape[0]:
            return
        if not started:
            state.base_pos = start_pos
        state.pending.append(rows)
        state.num_pending += rows.shape[0]

    def on_accepted(self, request_id: str, result: VerifyResult) -> None:
        """Drop the round's speculative entries; the accepted positions return as true features."""
        state = self._states.get(request_id)
        if state is not None:
            self.cache.resize(state.record, state.num_committed)

    def reset(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is not None:
            self.cache.free(state.record)

    def fork(self, parent_id: str, child_id: str) -> None:
        parent = self._states.get(parent_id)
        if parent is not None:
            self._states[child_id] = parent.fork(self._ensure_cache())

    def check_integrity(self) -> None:
        if self.cache is not None:
            self.cache.manager.check_integrity()
