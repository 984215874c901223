"""EAGLE-1 and EAGLE-3 proposers: a one-layer draft autoregressive over the target's features.

Pairing (EAGLE's): draft input i = (target feature at position i, token x_{i+1}); its output is the predicted
feature at position i + 1, whose logits propose x_{i+2}. The engine feeds the target's features of ACCEPTED
rows (add_features, consecutive positions); when it proposes for a sequence of length L (root at L - 1) the
tokens x_{i+1} of every fed position i <= L - 2 are known.

Per propose call, for all sequences at once:
1. ingest: one flattened forward over every (feature, next token) pair fed since the last call; these are
   the TRUE entries of the draft KV cache ("committed");
2. unroll: feed the draft's own output (EAGLE-1: predicted feature; EAGLE-3: pre-norm hidden) back with the
   drafted token, one step per further draft position. These entries are speculative: they are dropped on
   the next on_accepted / propose, and the accepted positions come back as true features and are ingested.
   chain: T = 0 -> argmax point masses; T > 0 -> tokens sampled from logits_to_probs rows (draft_probs).
   Where the draft's layers are native and every request is greedy or sampled at a plain temperature (rows
   softmax(logits / T)), a round of chains is one C call, the ingest included (the draft's draft_loop; an
   ingest of more than LOOP_CATCH_UP rows, such as a prompt's, first runs as a forward of its own and the
   chains' steps after their first token then run in one call).
   tree (EAGLE-2): DynamicTreeBuilder expands the top_k most valuable frontier nodes per depth (value: the
   calibrated acceptance of serve_eval.speculative.tree_budget under tree_budget='cost'); each depth runs
   the draft only on its new frontier nodes, which attend to the committed entries plus their tree
   ancestors' entries (serve_eval.speculative.proposers.eagle_tree). Tree nodes are point masses. Confidence is the plain softmax of the draft logits (EAGLE-2's),
   independent of the request's temperature, so T = 0 trees still branch. Under a cost budget a call drafts
   chains instead where they cost less per emitted token (TreeBudget.use_chain, measured per shape).

The draft KV cache is PAGED (its own KVCacheManager over its own block pool, kernels.attention for the
math): it batches sequences of different lengths in one forward with the same kernels the target uses
(Triton / flash on CUDA), and rollback is KVCacheManager.rollback, whose bookkeeping is already tested.
A cache index is `position - base_pos`, base_pos being the first fed position (a prefix-cache hit means the
target never computed features for the cached prefix; the draft then simply starts after it).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from draftsmith.kernels.attention import (
    AttentionMetadata,
)
from draftsmith.kernels.attention.torch_paged import paged_attention as torch_paged_attention
from draftsmith.kernels.layers.native_draft_loop import LOOP_CATCH_UP, LoopSampling, padded_tables
from draftsmith.kernels.sampling import logits_to_probs
from draftsmith.serve_eval.engine.threads import threads_for
from draftsmith.serve_eval.speculative.proposers.base import (
    Proposal,
    SequenceView,
    check_num_tokens,
    empty_proposal,
    sampling_arrays,
)
from draftsmith.serve_eval.speculative.proposers.draft_cache import DraftKVCache, _CacheRecord
from draftsmith.serve_eval.speculative.proposers.features import (
    draw_rows,
    engine_build_args,
    feed_features,
    load_feature_draft,
    serving_form,
)
from draftsmith.serve_eval.speculative.proposers.feature_state import FeatureCacheProposer, FeatureState
from draftsmith.serve_eval.speculative.proposers.registry import register_proposer
from draftsmith.serve_eval.speculative.proposers.eagle_tree import IncrementalTreeDrafter, TreeShapeLimits
from draftsmith.serve_eval.speculative.tree_budget import TreeBudget
from draftsmith.serve_eval.speculative.tree_dynamic import DynamicTreeBuilder

@dataclass
class _Query:
    """One sequence's slice of a draft forward: tokens at cache entries [num_entries - q, num_entries)."""

    state: FeatureState
    token_ids: list[int]
    hidden_in: Tensor  # [q, d]
    positions: list[int]


@register_proposer("eagle")
class EagleProposer(FeatureCacheProposer):
    """EAGLE-1: features are the target's final-norm hidden states; logits = lm_head(predicted feature)."""

    kind = "eagle"
    supports_tree = True
    tree_modes = ("dynamic",)
    aux_layers: tuple[int, ...] = ()

    def __init__(self, spec_config: Any, target_executor: Any, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, target_model_dir: str | Path | None = None) -> None:
        mode = getattr(spec_config, "tree", "none")
        if mode not in ("none", "dynamic"):
            raise ValueError(f"EAGLE proposes chains or EAGLE-2 dynamic trees (tree='dynamic'), got tree={mode!r}")
        loaded = load_feature_draft(spec_config, target_executor, device, dtype, (self.kind,), target_model_dir)
        tree = None
        if mode == "dynamic":
            tree = (spec_config.tree_top_k, spec_config.dynamic_depth, spec_config.max_draft_nodes)
        self._setup(loaded.model, num_blocks=spec_config.draft_num_blocks,
                    attn_backend=getattr(target_executor, "attn_backend", "auto"), tree=tree,
                    tree_budget=spec_config.make_tree_budget())

    @classmethod
    def from_spec_config(cls, spec_config: Any, engine: Any) -> "EagleProposer":
        """The registry's constructor (serve_eval.speculative.config): the engine's target, device and dtype."""
        return cls(*engine_build_args(spec_config, engine))

    @classmethod
    def from_draft(cls, draft: torch.nn.Module, **opts: Any) -> "EagleProposer":
        """Wrap an in-memory draft module (no target checks; tests). opts: see _setup."""
        proposer = cls.__new__(cls)
        proposer._setup(copy.deepcopy(draft), **opts)  # the caller keeps its (training-form) module
        return proposer

    def _setup(self, draft: torch.nn.Module, num_blocks: int | None = None, block_size: int = 16,
               attn_backend: str = "auto", tree: tuple[int, int, int] | None = None,
               tree_budget: TreeBudget | None = None) -> None:
        """num_blocks None: sized by attach(engine) (or DEFAULT_DRAFT_BLOCKS without an engine).
        tree: (top_k, depth, max_nodes) of the EAGLE-2 dynamic tree, or None for chains; tree_budget: the
        cost model that sizes those trees (None: exactly max_nodes by raw confidence)."""
        if getattr(draft, "kind", None) != self.kind:
            raise ValueError(f"{type(self).__name__} needs a {self.kind!r} draft, got {getattr(draft, 'kind', None)!r}")
        self.draft = serving_form(draft, copy_first=False)  # the engine's fused, packed layers (kernels.layers)
        self._init_cache_state(draft.fc.weight, num_blocks, block_size, attn_backend)
        self.tree = tree
        self.tree_budget = tree_budget if tree is not None else None
        if tree is not None:
            DynamicTreeBuilder(*tree)  # validates the options now, not at the first request

    def _draft_rows_per_seq(self, engine: Any) -> int:
        return engine.strategy.max_lookahead_tokens   # its round's lookahead (a chain's K, a tree's nodes)

    def _allocate(self, num_blocks: int) -> None:
        layer = self.draft.config.decoder
        self.cache = DraftKVCache(num_blocks, self.block_size, layer.num_key_value_heads, layer.head_dim,
                                  self.dtype, self.device, self.attn_backend)

    # -- kind-specific pieces (EAGLE-3 overrides) ---------------------------------------------
    @property
    def feature_width(self) -> int:
        return self.draft.config.hidden_size

    def _ingest_input(self, rows: Tensor) -> Tensor:  # fed rows [n, width] -> draft hidden input [n, d]
        return rows

    def _logits(self, hidden_out: Tensor) -> Tensor:  # -> target-vocab logits [n, V] float32
        return self.draft.compute_logits(hidden_out).float()

    def _target_rows(self, draft_probs: Tensor) -> Tensor:  # the draft loop's rows over its head -> target vocab
        return draft_probs

    def num_cached_entries(self, request_id: str) -> tuple[int, int]:
        """(committed entries, entries backed by blocks) of a request's draft cache (tests, stats)."""
        state = self._states[request_id]
        return state.num_committed, state.record.num_computed_tokens

    # -- proposing -----------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, seqs: Sequence[SequenceView], num_tokens: Sequence[int],
                features: Sequence[object] | None = None) -> list[Proposal]:
        check_num_tokens(num_tokens, len(seqs))
        feed_features(self, seqs, features)
        out = [empty_proposal(self.device) for _ in seqs]
        ready, queries = [], []
        for b, seq in enumerate(seqs):
            query = self._ingest_query(seq)
            if query is not None:
                ready.append(b)
                queries.append(query)
        if not ready:
            return out
        ready_seqs = [seqs[b] for b in ready]
        chains = self.tree is None or (self.tree_budget is not None and self.tree_budget.use_chain())
        looped = chains and self._loop_chains(ready_seqs, [num_tokens[b] for b in ready], queries)
        if looped:
            for b, proposal in zip(ready, looped):
                out[b] = proposal
            return out
        with threads_for(self.threads, sum(len(q.token_ids) for q in queries)):   # a catch-up may be long
            hidden = self._forward(queries)
        ends = torch.tensor([len(q.token_ids) for q in queries]).cumsum(0) - 1
        root_feats = hidden[ends.to(hidden.device)]  # [R, d]: predicted feature at each root position
        for q in queries:
            q.state.num_committed += len(q.token_ids)
        root_positions = [len(s.token_ids) - 1 for s in ready_seqs]
        if not chains:
            results = self._trees([q.state for q in queries], root_positions, root_feats)
        else:
            results = self._chains(ready_seqs, [num_tokens[b] for b in ready], [q.state for q in queries],
                                   root_positions, root_feats)
        for b, proposal in zip(ready, results):
            out[b] = proposal
        return out

    def _ingest_query(self, seq: SequenceView) -> _Query | None:
        """The fed (feature, next token) pairs up to the root, or None when this sequence cannot be drafted for."""
        state = self._states.get(seq.request_id)
        if state is None or state.base_pos is None:
            return None
        self.cache.resize(state.record, state.num_committed)  # speculative entries of an unverified proposal
        root = len(seq.token_ids) - 1
        first = state.base_pos + state.num_committed
        num_new = min(root - first, state.num_pending)
        if num_new <= 0 or first + num_new != root:  # features missing up to the root: no draft this step
            return None
        if not self.cache.resize(state.record, state.num_committed + num_new):
            return None  # draft pool full: skip speculation for this sequence this step
        rows = torch.cat(state.pending) if len(state.pending) > 1 else state.pending[0]
        state.pending = [rows[num_new:]] if rows.shape[0] > num_new else []
        state.num_pending -= num_new
        positions = list(range(first, root))
        return _Query(state, [seq.token_ids[p + 1] for p in positions], rows[:num_new], positions)

    def _forward(self, queries: list[_Query], ingest: bool = True) -> Tensor:
        """One flattened draft forward; each query's tokens are its cache's last entries. -> hidden out [T, d]."""
        lens = [len(q.token_ids) for q in queries]
        meta = AttentionMetadata.build(
            lens, [q.state.record.num_computed_tokens for q in queries],
            [self.cache.block_table(q.state.record) for q in queries], self.cache.block_size, self.device)
        hidden_in = torch.cat([q.hidden_in for q in queries])
        if ingest:
            hidden_in = self._ingest_input(hidden_in)
        input_ids = torch.tensor([t for q in queries for t in q.token_ids], dtype=torch.int64, device=self.device)
        positions = torch.tensor([p for q in queries for p in q.positions], dtype=torch.int64, device=self.device)
        return self.draft(input_ids, hidden_in, positions, self.cache.attn_fn(meta, self.draft.config.decoder.head_dim))

    # -- chains --------------------------------------------------------------------------------
    def _loop_chains(self, seqs, num_tokens, queries: list[_Query]) -> list[Proposal] | None:
        """A round of chains in one C call (the draft's draft_loop): each query's ingest rows as the first step,
        its first token picked from the last of them, then the further steps; each record grown first by the steps
        the pool allows it. None where that path does not serve (nothing was done): then the ingest forward."""
        loop = self.draft.draft_loop()   # EagleDraft's or Eagle3Draft's (None where C does not serve it)
        fed = [len(q.token_ids) for q in queries]
        if loop is None or max(fed) > LOOP_CATCH_UP or self.cache.attention is not torch_paged_attention:
            return None
        last = max(q.positions[0] + n_fed + n - 2 for q, n_fed, n in zip(queries, fed, num_tokens))
        if not loop.accepts(self.cache.layers(), last):
            return None
        sampling = LoopSampling.of([s.params for s in seqs], self.draft.config.vocab_size, [s.generator for s in seqs])
        if sampling is None:
            return None
        entries, steps = [], []
        for q, n_fed, n in zip(queries, fed, num_tokens):
            record = q.state.record   # _ingest_query made room for the ingest rows
            entries.append(record.num_computed_tokens - n_fed)
            steps.append(self._grow(record, n - 1) + 1)
        first_features = self._ingest_input(torch.cat([q.hidden_in for q in queries])).float().contiguous()
        more = loop([q.token_ids for q in queries], [q.positions[0] for q in queries], steps,
                    padded_tables([self.cache.block_table(q.state.record) for q in queries]), self.cache.layers(),
                    self.draft.config.decoder.head_dim ** -0.5, start_entries=entries,
                    features=torch.empty(len(queries), first_features.shape[1], dtype=torch.float32),
                    sampling=sampling, first_features=first_features)
        for q in queries:
            q.state.num_committed += len(q.token_ids)
        return [Proposal(torch.tensor(tokens, dtype=torch.int64, device=self.device),
                         None if probs is None else self._target_rows(probs))
                for tokens, probs in zip(more.tokens, more.probs)]

    def _grow(self, record: _CacheRecord, steps: int) -> int:
        """Room for up to `steps` more entries in a record, one at a time while the pool allows: how many it got."""
        grown = 0
        while grown < steps and self.cache.resize(record, record.num_computed_tokens + 1):
            grown += 1
        return grown

    def _chains(self, seqs, num_tokens, states, root_positions, feats: Tensor) -> list[Proposal]:
        temperature, top_k, top_p = sampling_arrays(seqs, self.device)
        greedy = [s.params.temperature == 0 for s in seqs]
        tokens: list[list[int]] = [[] for _ in seqs]
        rows: list[list[Tensor]] = [[] for _ in seqs]
        active = list(range(len(seqs)))
        step_feats = feats
        for step in range(max(num_tokens)):
            logits = self._logits(step_feats)
            if all(greedy[i] for i in active):
                # T = 0 drafts are point masses: logits_to_probs would give one-hot rows at this same argmax.
                drawn, probs = logits.argmax(dim=-1), None
            else:
                idx = torch.tensor(active, device=self.device)
                probs = logits_to_probs(logits, temperature[idx], top_k[idx], top_p[idx])
                drawn = draw_rows(probs, [seqs[i].generator for i in active], [greedy[i] for i in active])
            drawn_ids = drawn.tolist()
            for j, i in enumerate(active):
                tokens[i].append(drawn_ids[j])
                if probs is not None:
                    rows[i].append(probs[j])
            if step == 0 and self._loop_rest(seqs, states, tokens, rows, num_tokens, root_positions, feats,
                                             logits.shape[-1]):
                break
            # grow the chain of sequences that want more tokens: input (own output, drafted token) at root + step
            keep = [j for j, i in enumerate(active) if len(tokens[i]) < num_tokens[i]
                    and self.cache.resize(states[i].record, states[i].record.num_computed_tokens + 1)]
            if not keep:
                break
            queries = [_Query(states[active[j]], [drawn_ids[j]], step_feats[j:j + 1], [root_positions[active[j]] + step])
                       for j in keep]
            step_feats = self._forward(queries, ingest=False)
            active = [active[j] for j in keep]
        return [Proposal(torch.tensor(t, dtype=torch.int64, device=self.device),
                         None if greedy[i] else torch.stack(rows[i])) for i, t in enumerate(tokens)]

    def _loop_rest(self, seqs, states, tokens, rows, num_tokens, root_positions, feats: Tensor,
                   vocab_size: int) -> bool:
        """Every sequence's first token drawn, each greedy or sampled at a plain temperature: the chains' remaining
        steps in one C call (the draft's draft_loop), each record grown first by the steps the pool allows it
        (sequence by sequence, where the Python steps grow them step by step: on a nearly full pool the first ones
        get the room). False where that path does not serve, and nothing was done."""
        loop = self.draft.draft_loop()   # EagleDraft's or Eagle3Draft's (None where C does not serve it)
        last = max(p + n - 1 for p, n in zip(root_positions, num_tokens))
        if (loop is None or max(num_tokens) < 2 or self.cache.attention is not torch_paged_attention
                or not loop.accepts(self.cache.layers(), last)):
            return False
        sampling = LoopSampling.of([s.params for s in seqs], vocab_size, [s.generator for s in seqs])
        if sampling is None:
            return False
        entries, steps = [], []
        for state, n in zip(states, num_tokens):
            record = state.record
            entries.append(record.num_computed_tokens)
            steps.append(self._grow(record, n - 1))
        more = loop([[t[0]] for t in tokens], root_positions, steps,
                    padded_tables([self.cache.block_table(state.record) for state in states]),
                    self.cache.layers(), self.draft.config.decoder.head_dim ** -0.5, start_entries=entries,
                    features=feats.float().contiguous().clone(), sampling=sampling)
        for chain, row_list, new, probs in zip(tokens, rows, more.tokens, more.probs):
            chain.extend(new)
            if probs is not None:
                row_list.extend(self._target_rows(probs).unbind(0))
        return True

    # -- EAGLE-2 dynamic trees (serve_eval.speculative.proposers.eagle_tree) ---------------------
    def _trees(self, states, root_positions, root_feats: Tensor) -> list[Proposal]:
        drafter = IncrementalTreeDrafter(self.draft, self._logits, self.cache, self.draft.config.decoder.head_dim,
                                         TreeShapeLimits(*self.tree), self.tree_budget)
        trees = drafter.grow([s.record for s in states], [s.num_committed for s in states], root_positions,
                             root_feats)
        return [Proposal(t.tokens, None, t) for t in trees]
