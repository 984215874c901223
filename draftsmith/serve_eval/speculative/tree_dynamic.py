"""EAGLE-2-style dynamic draft trees: expand the most valuable frontier, then keep the most valuable nodes.

The proposer drives a builder: `add_root_candidates` with the draft's top-k at the root, then repeatedly runs
its draft on the returned frontier and calls `add_children`; `build()` keeps the best candidates.

A node's score is the log of its value, accumulated along its path:
- without a budget (EAGLE-2): the draft's confidence (its softmax probability), max_nodes nodes kept;
- with a TreeBudget (serve_eval.speculative.tree_budget): the calibrated probability of acceptance given
  the parent's, so the value is the probability the node is accepted; only frontier nodes worth a node's
  verification are expanded, and the kept count maximises expected tokens per second of the round. Until
  the budget has seen a verified tree (or when nobody feeds it), ranking stays EAGLE-2's; the nodes' cells
  are recorded all the same, so the first verified trees calibrate it.
Every factor is <= 1 (calibrated ones < 1), so a child never outranks its parent (ties go to the earlier-
created node, the parent) and every kept prefix of the ranking is closed under ancestors. All nodes are point
masses: their tokens are a deterministic function of the context, which keeps verification exact.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from draftsmith.serve_eval.speculative.tree import DraftTree
from draftsmith.serve_eval.speculative.tree_budget import TreeBudget


class DynamicTreeBuilder:
    def __init__(self, top_k: int, depth: int, max_nodes: int, budget: TreeBudget | None = None) -> None:
        for name, value in (("top_k", top_k), ("depth", depth), ("max_nodes", max_nodes)):
            if value <= 0:
                raise ValueError(f"dynamic tree {name} must be > 0, got {value}")
        self.top_k, self.depth, self.max_nodes, self.budget = top_k, depth, max_nodes, budget
        # Expansion floor: log-value a frontier node needs to be drafted further (-inf: no floor).
        threshold = budget.expand_threshold() if budget is not None else 0.0
        self._min_expand_score = math.log(threshold) if threshold > 0 else -math.inf
        self._tokens: list[int] = []
        self._parents: list[int] = []
        self._depths: list[int] = []
        self._scores: list[float] = []  # cumulative log-value
        self._cells: list[int] = []  # calibration cell per candidate (budgeted builders only)
        # bool [cap, cap] over rows (0 = root, id + 1 = candidate), grown as candidates arrive: a new row
        # is its parent's row plus itself, so each add costs one row gather, never a recomputation.
        self._anc = torch.eye(1 + top_k * (1 + (depth - 1) * top_k), dtype=torch.bool)

    @property
    def num_candidates(self) -> int:
        return len(self._tokens)

    def candidates(self) -> DraftTree:
        """Every candidate so far as one tree, in creation order (the ids add_children returns), so a
        proposer reads their depths and ancestor masks from DraftTree instead of tracking them itself."""
        n = len(self._tokens)
        return DraftTree._trusted(torch.tensor(self._tokens, dtype=torch.int64),
                                  torch.tensor(self._parents, dtype=torch.int64),
                                  torch.tensor(self._depths, dtype=torch.int64), ancestors=self._anc[: n + 1, : n + 1])

    def node_inputs(self, ids: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
        """(tokens, parents, depths) of candidates `ids` (parent -1 = the root): what a draft step feeds them."""
        return ([self._tokens[i] for i in ids], [self._parents[i] for i in ids], [self._depths[i] for i in ids])

    def ancestor_mask(self, query_ids: Sequence[int], key_ids: Sequence[int]) -> Tensor:
        """bool [len(query_ids), len(key_ids)]: key candidate is the query itself or one of its ancestors."""
        rows = torch.tensor(query_ids, dtype=torch.int64) + 1
        cols = torch.tensor(key_ids, dtype=torch.int64) + 1
        return self._anc[rows][:, cols]

    def _extend_ancestors(self, first: int) -> None:
        """Ancestor rows of candidates first.. (rows already written never change)."""
        end = len(self._tokens) + 1
        if end > self._anc.shape[0]:  # more candidates than top_k per parent: grow
            grown = torch.eye(2 * end, dtype=torch.bool)
            grown[: self._anc.shape[0], : self._anc.shape[0]] = self._anc
            self._anc = grown
        rows = torch.arange(first + 1, end)
        self._anc[rows] = self._anc[torch.tensor(self._parents[first:], dtype=torch.int64) + 1]
        self._anc[rows, rows] = True

    def add_root_candidates(self, tokens: Tensor, probs: Tensor) -> list[int]:  # tokens, probs [k]
        if self._tokens:
            raise ValueError("add_root_candidates called twice on one DynamicTreeBuilder")
        return self.add_children([-1], tokens.reshape(1, -1), probs.reshape(1, -1))

    def _log_factors(self, depths: list[int], probs: Tensor) -> list[float]:
        """log of each new candidate's factor: its confidence, or its calibrated conditional acceptance.
        probs [P, k]: column j is the parent's j-th candidate (its sibling rank)."""
        confidence = [math.log(max(p, 1e-30)) for p in probs.reshape(-1).tolist()]
        if self.budget is None:
            return confidence
        num_parents, k = probs.shape
        ranks = torch.arange(k).expand(num_parents, k)
        depth = torch.tensor(depths, dtype=torch.int64)[:, None].expand(num_parents, k)
        cells = self.budget.calibration.cells(depth, ranks, probs.cpu()).reshape(-1)
        self._cells.extend(cells.tolist())
        if not self.budget.calibration.rounds:
            return confidence
        return self.budget.calibration.conditional(cells).log().tolist()

    def add_children(self, parent_ids: Sequence[int], tokens: Tensor, probs: Tensor) -> list[int]:
        """tokens, probs [P, k]: candidates below each parent. Returns the next frontier to expand."""
        if tokens.shape != probs.shape or tokens.dim() != 2 or tokens.shape[0] != len(parent_ids):
            raise ValueError(
                f"dynamic tree: tokens shape {tuple(tokens.shape)}, probs shape {tuple(probs.shape)} "
                f"and {len(parent_ids)} parents do not match"
            )
        first, width = len(self._tokens), tokens.shape[1]
        depths = [1 if p == -1 else self._depths[p] + 1 for p in parent_ids]
        factors = self._log_factors(depths, probs)
        for j, (parent, depth) in enumerate(zip(parent_ids, depths)):
            base = 0.0 if parent == -1 else self._scores[parent]
            self._parents.extend([parent] * width)
            self._depths.extend([depth] * width)
            self._scores.extend(base + f for f in factors[j * width:(j + 1) * width])
        self._tokens.extend(tokens.reshape(-1).tolist())
        self._extend_ancestors(first)
        new_ids = range(first, len(self._tokens))
        if not new_ids or self._depths[first] >= self.depth:
            return []
        worth = [i for i in new_ids if self._scores[i] >= self._min_expand_score]
        worth.sort(key=lambda i: (-self._scores[i], i))
        return worth[: self.top_k]

    def build(self) -> DraftTree:
        ranked = sorted(range(len(self._tokens)), key=lambda i: (-self._scores[i], i))
        count = self.max_nodes
        if self.budget is not None:
            values = torch.tensor([self._scores[i] for i in ranked[: self.max_nodes]], dtype=torch.float64).exp()
            count = self.budget.keep_count(values, self.max_nodes)
        kept = set(ranked[:count])
        order = sorted(kept, key=lambda i: (self._depths[i], i))
        new_id = {old: new for new, old in enumerate(order)}
        parents = []
        for old in order:
            parent = self._parents[old]
            if parent != -1 and parent not in kept:  # cannot happen with factors <= 1; guard anyway
                raise ValueError(f"dynamic tree kept node {old} without its parent {parent} (confidence > 1?)")
            parents.append(-1 if parent == -1 else new_id[parent])
        # Kept set closed under ancestors and ordered by depth: parents precede children, and depths and
        # ancestor rows carry over (restricted to the kept rows).
        rows = torch.tensor([0] + [i + 1 for i in order], dtype=torch.int64)
        cells = torch.tensor([self._cells[i] for i in order], dtype=torch.int64) if self.budget is not None else None
        return DraftTree._trusted(torch.tensor([self._tokens[i] for i in order], dtype=torch.int64),
                                  torch.tensor(parents, dtype=torch.int64),
                                  torch.tensor([self._depths[i] for i in order], dtype=torch.int64),
                                  ancestors=self._anc[rows][:, rows], cells=cells)
