"""EAGLE-2 dynamic trees drafted incrementally: each depth runs the draft once, over its new frontier only.

A DynamicTreeBuilder chooses, depth after depth, which candidates to expand (the frontier). A frontier node's
draft input is (its parent's output hidden, its own token) at position root + depth - 1; its K/V is appended
to the sequence's draft cache after the tree entries of earlier depths, and it attends to the committed
entries plus its tree ancestors (serve_eval.speculative.proposers.tree_attention). A depth therefore costs one
draft forward over its new nodes, not over every node expanded so far. The entries stay speculative: the
proposer rolls the cache back to its committed entries before the next ingest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from draftsmith.kernels.layers.decoder import AttnFn
from draftsmith.serve_eval.speculative.proposers.draft_cache import DraftKVCache, _CacheRecord
from draftsmith.serve_eval.speculative.proposers.tree_attention import TreeStepLayout, tree_attn_fn
from draftsmith.serve_eval.speculative.tree import DraftTree
from draftsmith.serve_eval.speculative.tree_budget import TreeBudget
from draftsmith.serve_eval.speculative.tree_dynamic import DynamicTreeBuilder

# (input_ids [T], hidden_in [T, d], positions [T], attn_fn) -> output hidden [T, d]: one draft forward
DraftStep = Callable[[Tensor, Tensor, Tensor, AttnFn], Tensor]


@dataclass(frozen=True)
class TreeShapeLimits:
    top_k: int  # candidates per expanded node, and frontier width
    depth: int
    max_nodes: int

    @property
    def max_candidates(self) -> int:  # root's top_k, then at most top_k expanded nodes per later depth
        return self.top_k + max(self.depth - 1, 0) * self.top_k * self.top_k


@dataclass
class _GrowingTree:
    record: _CacheRecord  # the sequence's draft cache
    num_committed: int  # true entries before the tree's
    root_position: int
    builder: DynamicTreeBuilder
    outputs: Tensor  # [1 + max_candidates, d]: row 0 the root's predicted feature, id + 1 an expanded node's output
    frontier: list[int]
    expanded: list[int] = field(default_factory=list)  # candidate ids in cache order: entry num_committed + j


class IncrementalTreeDrafter:
    """Grows one tree per sequence, all sequences of a depth in one draft forward."""

    def __init__(self, draft_step: DraftStep, logits: Callable[[Tensor], Tensor], cache: DraftKVCache,
                 head_dim: int, limits: TreeShapeLimits, budget: TreeBudget | None = None) -> None:
        self.draft_step, self.logits, self.cache = draft_step, logits, cache
        self.scale = head_dim ** -0.5
        self.limits, self.budget = limits, budget

    def grow(self, records: Sequence[_CacheRecord], num_committed: Sequence[int], root_positions: Sequence[int],
             root_feats: Tensor) -> list[DraftTree]:
        """root_feats [B, d]: the draft's predicted feature at each sequence's root (after its ingest)."""
        lim = self.limits
        conf, cand = self.candidates(root_feats)
        trees = []
        for i, record in enumerate(records):
            builder = DynamicTreeBuilder(lim.top_k, lim.depth, lim.max_nodes, self.budget)
            outputs = root_feats.new_empty(1 + lim.max_candidates, root_feats.shape[-1])
            outputs[0] = root_feats[i]
            trees.append(_GrowingTree(record, num_committed[i], root_positions[i], builder, outputs,
                                      builder.add_root_candidates(cand[i], conf[i])))
        active = [t for t in trees if t.frontier]
        while active:
            hidden = self._depth_forward(active)  # one row per frontier node, tree after tree
            conf, cand = self.candidates(hidden)
            row = 0
            for t in active:
                width = len(t.frontier)
                t.outputs[torch.tensor(t.frontier) + 1] = hidden[row:row + width]
                t.frontier = t.builder.add_children(t.frontier, cand[row:row + width], conf[row:row + width])
                row += width
            active = [t for t in active if t.frontier]
        return [t.builder.build() for t in trees]

    def _depth_forward(self, active: list[_GrowingTree]) -> Tensor:
        """Append every active tree's frontier to its cache and run the draft over those nodes only."""
        device = active[0].outputs.device
        tokens: list[int] = []
        positions: list[int] = []
        inputs, masks = [], []
        for t in active:
            t.expanded.extend(t.frontier)
            if not self.cache.resize(t.record, t.num_committed + len(t.expanded)):
                raise RuntimeError("EAGLE draft KV pool exhausted while growing a tree (raise draft_num_blocks)")
            node_tokens, parents, depths = t.builder.node_inputs(t.frontier)
            tokens.extend(node_tokens)
            positions.extend(t.root_position + d - 1 for d in depths)  # a depth-d node is fed at root + d - 1
            inputs.append(t.outputs[torch.tensor(parents, device=device) + 1])
            masks.append(t.builder.ancestor_mask(t.frontier, t.expanded))
        layout = TreeStepLayout.build([self.cache.block_table(t.record) for t in active], self.cache.block_size,
                                      [t.num_committed for t in active], masks, device)
        attn = tree_attn_fn(self.cache.k_cache, self.cache.v_cache, layout, self.scale)
        return self.draft_step(torch.tensor(tokens, dtype=torch.int64, device=device), torch.cat(inputs),
                               torch.tensor(positions, dtype=torch.int64, device=device), attn)

    def candidates(self, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """(confidence, token) [n, top_k] of the draft's plain softmax: EAGLE-2's ranking signal."""
        top = torch.softmax(self.logits(hidden), dim=-1).topk(self.limits.top_k, dim=-1)
        return top.values.cpu(), top.indices.cpu()
