"""Block-parallel proposer (DFlash-style): ONE draft forward per round returns a chain of K tokens.

Per propose call, for all sequences at once:
1. inject: the target's aux rows fed since the last call (consecutive positions up to root - 1) are fused and
   projected into every draft layer's paged KV (k/v projections only: no queries, no MLP). These entries are the
   committed context;
2. block: ``[root, mask_1 .. mask_M]`` (M = the trained K_max) at positions root .. root + M runs through the
   draft layers in one flattened forward over the paged cache, with an all-true tree mask (bidirectional inside
   the block, every committed context entry visible). Offsets 1..K give the K draft rows.
   T = 0: argmax point masses; T > 0: each token drawn from its own ``logits_to_probs`` row with the request's
   generator (the rows do not condition on each other's draws, which rejection sampling allows: each row is the
   exact distribution its token came from, as for Medusa's heads).
The block's own KV entries are speculative and dropped at on_accepted; accepted positions come back as target
features and are injected next time. Verification, rollback and metrics are the strategy's, as for every kind.

A prefix-cache hit means no features exist for the cached prompt start: the context then starts after it
(cache index = position - base_pos, RoPE at absolute positions).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from draftsmith.drafts.block import check_aux_layers, check_block_k
from draftsmith.kernels.attention import AttentionMetadata, paged_attn_fn
from draftsmith.kernels.layers.decoder import AttnFn
from draftsmith.kernels.sampling import logits_to_probs
from draftsmith.serve_eval.engine.threads import threads_for
from draftsmith.serve_eval.speculative.proposers.base import (
    Proposal,
    SequenceView,
    check_num_tokens,
    empty_proposal,
    sampling_arrays,
)
from draftsmith.serve_eval.speculative.proposers.draft_cache import DraftKVCache
from draftsmith.serve_eval.speculative.proposers.features import (
    draw_rows,
    engine_build_args,
    feed_features,
    load_feature_draft,
    serving_form,
)
from draftsmith.serve_eval.speculative.proposers.feature_state import FeatureCacheProposer, FeatureState
from draftsmith.serve_eval.speculative.proposers.registry import register_proposer


class LayeredKVCache(DraftKVCache):
    """DraftKVCache with one K/V pair per draft layer, all under the same block tables."""

    def __init__(self, num_layers: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.k_caches = [self.k_cache] + [torch.zeros_like(self.k_cache) for _ in range(num_layers - 1)]
        self.v_caches = [self.v_cache] + [torch.zeros_like(self.v_cache) for _ in range(num_layers - 1)]

    def layer_attn_fns(self, meta: AttentionMetadata, head_dim: int) -> list[AttnFn]:
        return [paged_attn_fn(self.attention, k, v, meta, head_dim ** -0.5) for k, v in zip(self.k_caches, self.v_caches)]

    def layers(self) -> list[tuple[Tensor, Tensor]]:
        return list(zip(self.k_caches, self.v_caches))


@register_proposer("block")
class BlockProposer(FeatureCacheProposer):
    kind = "block"
    feature_name = "aux"
    supports_tree = False

    def __init__(self, spec_config: Any, target_executor: Any, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, target_model_dir: str | Path | None = None) -> None:
        if getattr(spec_config, "tree", "none") != "none":
            raise ValueError(f"the block proposer proposes chains, got tree={spec_config.tree!r}")
        loaded = load_feature_draft(spec_config, target_executor, device, dtype, (self.kind,), target_model_dir)
        num_target_layers = getattr(target_executor, "num_layers", None)
        if num_target_layers is not None:
            check_aux_layers(list(loaded.model.config.aux_layers), int(num_target_layers))
        check_block_k(spec_config.max_lookahead_tokens, loaded.model.config.block_size)
        self._setup(serving_form(loaded.model, copy_first=False), num_blocks=spec_config.draft_num_blocks,
                    attn_backend=getattr(target_executor, "attn_backend", "auto"))

    @classmethod
    def from_spec_config(cls, spec_config: Any, engine: Any) -> "BlockProposer":
        return cls(*engine_build_args(spec_config, engine))

    @classmethod
    def from_draft(cls, draft: torch.nn.Module, **opts: Any) -> "BlockProposer":
        """Wrap an in-memory BlockDraft (no target checks; tests)."""
        proposer = cls.__new__(cls)
        proposer._setup(serving_form(draft), **opts)
        return proposer

    def _setup(self, draft: torch.nn.Module, num_blocks: int | None = None, block_size: int = 16,
               attn_backend: str = "auto") -> None:
        if getattr(draft, "kind", None) != self.kind:
            raise ValueError(f"BlockProposer needs a 'block' draft, got {getattr(draft, 'kind', None)!r}")
        self.draft = draft
        self.aux_layers = tuple(draft.config.aux_layers)
        self.width = draft.config.block_size  # query block length (1 root + K_max masks)
        self._init_cache_state(draft.fc.weight, num_blocks, block_size, attn_backend)
        self._block_masks: dict[int, Tensor] = {}
        self.num_forwards = 0  # block forwards run (one per propose call with any ready sequence)

    def _draft_rows_per_seq(self, engine: Any) -> int:
        return self.width   # its query block

    def _allocate(self, num_blocks: int) -> None:
        layer = self.draft.config.decoder
        self.cache = LayeredKVCache(self.draft.config.num_layers, num_blocks, self.block_size,
                                    layer.num_key_value_heads, layer.head_dim, self.dtype, self.device, self.attn_backend)

    # -- features ----------------------------------------------------------------------------
    @property
    def feature_width(self) -> int:
        return len(self.aux_layers) * self.draft.config.target_hidden_size

    # -- proposing -----------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, seqs: Sequence[SequenceView], num_tokens: Sequence[int],
                features: Sequence[object] | None = None) -> list[Proposal]:
        check_num_tokens(num_tokens, len(seqs))
        for k in num_tokens:
            check_block_k(k, self.width)
        feed_features(self, seqs, features)
        out = [empty_proposal(self.device) for _ in seqs]
        ready, rows = [], []
        for b, seq in enumerate(seqs):
            new_rows = self._claim(seq)
            if new_rows is not None:
                ready.append(b)
                rows.append(new_rows)
        if not ready:
            return out
        states = [self._states[seqs[b].request_id] for b in ready]
        self._inject(states, rows)
        # [R, K, V]: only the offsets some sequence asked for go through the head
        logits = self._block_forward([seqs[b] for b in ready], states, max(num_tokens[b] for b in ready))
        for b, proposal in zip(ready, self._chains([seqs[b] for b in ready], [num_tokens[b] for b in ready], logits)):
            out[b] = proposal
        return out

    def _claim(self, seq: SequenceView) -> Tensor | None:
        """The fed aux rows up to root - 1 not injected yet ([n, A d_t], n may be 0), with cache entries for them
        and the block reserved; None when this sequence cannot be drafted for this step."""
        state = self._states.get(seq.request_id)
        if state is None or state.base_pos is None:
            return None
        self.cache.resize(state.record, state.num_committed)  # the block of an unverified proposal
        root = len(seq.token_ids) - 1
        first = state.base_pos + state.num_committed
        num_new = min(root - first, state.num_pending)
        if num_new < 0 or first + num_new != root:  # features missing up to the root: no draft this step
            return None
        if not self.cache.resize(state.record, state.num_committed + num_new + self.width):
            self.cache.resize(state.record, state.num_committed)
            return None  # draft pool full: skip speculation for this sequence this step
        pending = torch.cat(state.pending) if len(state.pending) > 1 else (state.pending[0] if state.pending else None)
        if pending is None:
            return torch.zeros(0, self.feature_width, dtype=self.dtype, device=self.device)
        state.pending = [pending[num_new:]] if pending.shape[0] > num_new else []
        state.num_pending -= num_new
        return pending[:num_new]

    def _inject(self, states: list[FeatureState], rows: list[Tensor]) -> None:
        """Project every new context row into every layer's KV at its committed cache entry."""
        todo = [(s, r) for s, r in zip(states, rows) if r.shape[0]]
        if todo:
            slots, positions = [], []
            for state, r in todo:
                table = self.cache.block_table(state.record)
                for idx in range(state.num_committed, state.num_committed + r.shape[0]):
                    slots.append(table[idx // self.block_size] * self.block_size + idx % self.block_size)
                    positions.append(state.base_pos + idx)
            aux = torch.cat([r for _, r in todo]) if len(todo) > 1 else todo[0][1]
            with threads_for(self.threads, len(slots)):   # after plain steps, every token since (16 x 64 at batch 16)
                self.draft.inject_context(aux, torch.tensor(positions, dtype=torch.int64, device=self.device),
                                          max(positions), self.cache.layers(),
                                          torch.tensor(slots, dtype=torch.int64, device=self.device))
        for state, r in zip(states, rows):
            state.num_committed += r.shape[0]

    def _block_forward(self, seqs: list[SequenceView], states: list[FeatureState], k: int) -> Tensor:
        """One flattened forward of every ready sequence's (full, trained) query block -> draft logits of offsets
        1..k [R, k, V] float32."""
        width, num = self.width, len(seqs)
        tree_mask = self._block_mask(num)
        meta = AttentionMetadata.build([width] * num, [s.num_committed + width for s in states],
                                       [self.cache.block_table(s.record) for s in states], self.block_size,
                                       self.device, tree_mask)
        roots = torch.tensor([s.token_ids[-1] for s in seqs], dtype=torch.int64, device=self.device)
        hidden = self.draft.block_embeds(roots).reshape(num * width, -1)  # [R W, d]
        roots_at = [len(s.token_ids) - 1 for s in seqs]
        positions = torch.tensor([at + j for at in roots_at for j in range(width)], device=self.device)
        # Only offsets 1..k leave the last layer: each block's rows b * width + 1 .. b * width + k
        out_rows = slice(1, k + 1) if num == 1 else (
            torch.arange(num, device=self.device)[:, None] * width + torch.arange(1, k + 1, device=self.device)).reshape(-1)
        out = self.draft(hidden, positions, self.cache.layer_attn_fns(meta, self.draft.config.decoder.head_dim), out_rows,
                         max(roots_at) + width - 1)
        self.num_forwards += 1
        return self.draft.compute_logits(out.view(num, k, -1)).float()

    def _block_mask(self, num: int) -> Tensor:
        """[num W, W] all true: every block is bidirectional (built once per batch size; the attention reads it)."""
        mask = self._block_masks.get(num)
        if mask is None:
            mask = self._block_masks[num] = torch.ones(num * self.width, self.width, dtype=torch.bool, device=self.device)
        return mask

    def _chains(self, seqs: list[SequenceView], counts: list[int], logits: Tensor) -> list[Proposal]:
        rows = torch.cat([logits[i, :k] for i, k in enumerate(counts)])  # [sum k, V]
        if all(s.params.temperature == 0 for s in seqs):  # point masses: logits_to_probs would be one-hot here
            tokens, probs = rows.argmax(dim=-1), None
        else:
            temperature, top_k, top_p = sampling_arrays(seqs, rows.device)
            repeat = torch.tensor(counts, device=rows.device)
            probs = logits_to_probs(rows, temperature.repeat_interleave(repeat), top_k.repeat_interleave(repeat),
                                    top_p.repeat_interleave(repeat))
            greedy = [s.params.temperature == 0 for s, k in zip(seqs, counts) for _ in range(k)]
            tokens = draw_rows(probs, [s.generator for s, k in zip(seqs, counts) for _ in range(k)], greedy)
        out, start = [], 0
        for s, k in zip(seqs, counts):
            point_mass = probs is None or s.params.temperature == 0
            out.append(Proposal(tokens[start:start + k], None if point_mass else probs[start:start + k]))
            start += k
        return out
