"""Draft trees: the data structure, static (Medusa-style) shapes, and what the target forward needs from a
tree (attention mask, positions, paths). EAGLE-2-style dynamic construction: serve_eval.speculative.tree_dynamic.

Indexing used everywhere:
- nodes 0..N-1 are topologically ordered (parents[i] < i); parents[i] == -1 means the root, which
  is the last emitted token (not a draft);
- depths[i] = 1 + depth of the parent, the root has depth 0, so node i sits at position
  root_position + depths[i];
- in the target forward a sequence's query tokens are [root, node 0, ..., node N-1]; "row" r = 0 is
  the root and row i + 1 is node i (target_probs [N+1, V] follows the same rows).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import Tensor

from draftsmith.serve_eval.speculative.tree_geometry import tree_ancestors, tree_depths


def check_node_budget(num_nodes: int, max_nodes: int | None, what: str = "draft tree") -> None:
    """ValueError naming both values when a tree exceeds the configured node budget."""
    if max_nodes is not None and num_nodes > max_nodes:
        raise ValueError(f"{what} has {num_nodes} nodes but the node budget (max_draft_nodes) is {max_nodes}")


@dataclass(eq=False)
class DraftTree:
    """A draft tree and its geometry: depths, ancestors, positions and paths, all from `parents`.

    This is the one place tree geometry is computed; the strategy, the verifier and the proposers read it
    from here. Depths are computed at construction (validated against a given `depths`), the ancestor
    matrix on first use and cached.
    """

    tokens: Tensor  # int64 [N]
    parents: Tensor  # int64 [N], -1 = root, parents[i] < i
    depths: Tensor | None = None  # int64 [N], derived from parents when None
    # [N, V] draft distribution each node was sampled from, or None when every node is a point mass.
    draft_probs: Tensor | None = None
    # bool [N]: rows of draft_probs to ignore (point mass on the node's token, e.g. top-k children).
    point_mass: Tensor | None = None
    # int64 [N]: each node's acceptance-calibration cell (serve_eval.speculative.tree_budget), set by a
    # cost-budgeted dynamic builder so the verified round can update the calibration; None otherwise.
    cells: Tensor | None = None
    _ancestors: Tensor | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.tokens = torch.as_tensor(self.tokens, dtype=torch.int64)
        self.parents = torch.as_tensor(self.parents, dtype=torch.int64, device=self.tokens.device)
        num_nodes = self.tokens.numel()
        if self.tokens.dim() != 1 or self.parents.shape != self.tokens.shape:
            raise ValueError(
                f"tree tokens shape {tuple(self.tokens.shape)} and parents shape "
                f"{tuple(self.parents.shape)} must both be [N]"
            )
        node_ids = torch.arange(num_nodes, device=self.parents.device)
        if bool(((self.parents < -1) | (self.parents >= node_ids)).any()):
            raise ValueError(f"tree parents must satisfy -1 <= parents[i] < i, got {self.parents.tolist()}")
        expected = tree_depths(self.parents)
        if self.depths is None:
            self.depths = expected
        else:
            self.depths = torch.as_tensor(self.depths, dtype=torch.int64, device=self.parents.device)
            if not torch.equal(self.depths, expected):
                raise ValueError(
                    f"tree depths {self.depths.tolist()} disagree with parents (expected {expected.tolist()})"
                )
        self._check_probs(num_nodes)

    def _check_probs(self, num_nodes: int) -> None:
        if self.draft_probs is not None and (self.draft_probs.dim() != 2 or self.draft_probs.shape[0] != num_nodes):
            raise ValueError(
                f"draft_probs shape {tuple(self.draft_probs.shape)} does not match the tree's {num_nodes} nodes"
            )
        if self.cells is not None and tuple(self.cells.shape) != (num_nodes,):
            raise ValueError(f"tree cells shape {tuple(self.cells.shape)} does not match the tree's {num_nodes} nodes")
        if self.point_mass is not None:
            self.point_mass = torch.as_tensor(self.point_mass, dtype=torch.bool, device=self.tokens.device)
            if self.point_mass.shape != (num_nodes,):
                raise ValueError(
                    f"point_mass shape {tuple(self.point_mass.shape)} does not match the tree's {num_nodes} nodes"
                )

    @classmethod
    def chain(cls, tokens: Tensor | Sequence[int], draft_probs: Tensor | None = None) -> DraftTree:
        """A chain of K drafts is the tree where node i's parent is node i - 1."""
        tokens = torch.as_tensor(tokens, dtype=torch.int64)
        parents = torch.arange(tokens.numel(), device=tokens.device) - 1
        tree = cls._trusted(tokens, parents, parents + 2, draft_probs)
        tree._check_probs(tree.num_nodes)
        return tree

    @classmethod
    def _trusted(cls, tokens: Tensor, parents: Tensor, depths: Tensor, draft_probs: Tensor | None = None,
                 point_mass: Tensor | None = None, ancestors: Tensor | None = None,
                 cells: Tensor | None = None) -> DraftTree:
        """A tree whose geometry is right by construction (chains, prefixes, the dynamic builder):
        validation costs more than the rest of a small tree's bookkeeping, so it is skipped."""
        tree = cls.__new__(cls)
        tree.tokens, tree.parents, tree.depths = tokens, parents, depths
        tree.draft_probs, tree.point_mass, tree._ancestors = draft_probs, point_mass, ancestors
        tree.cells = cells
        return tree

    @classmethod
    def from_rows(cls, tokens, parents, rows: Sequence[Tensor | None], vocab_size: int) -> DraftTree:
        """Build from per-node draft distributions where None means a point mass on the node's token."""
        tokens = torch.as_tensor(tokens, dtype=torch.int64)
        if len(rows) != tokens.numel():
            raise ValueError(f"got {len(rows)} draft_probs rows for {tokens.numel()} tree nodes")
        if all(row is None for row in rows):
            return cls(tokens, parents)
        probs = torch.zeros(len(rows), vocab_size)
        for i, row in enumerate(rows):
            if row is not None:
                probs[i] = row
        return cls(tokens, parents, draft_probs=probs, point_mass=torch.tensor([row is None for row in rows]))

    def prefix(self, num_nodes: int) -> DraftTree:
        """The first num_nodes nodes (node order is topological, so a prefix keeps every ancestor).
        The cached geometry is sliced, not recomputed."""
        if num_nodes >= self.num_nodes:
            return self
        n = max(num_nodes, 0)
        return DraftTree._trusted(
            self.tokens[:n], self.parents[:n], self.depths[:n],
            None if self.draft_probs is None else self.draft_probs[:n],
            None if self.point_mass is None else self.point_mass[:n],
            None if self._ancestors is None else self._ancestors[: n + 1, : n + 1],
            None if self.cells is None else self.cells[:n],
        )

    @property
    def num_nodes(self) -> int:
        return self.tokens.numel()

    @property
    def max_depth(self) -> int:
        return int(self.depths.max()) if self.num_nodes else 0

    @property
    def is_chain(self) -> bool:
        return bool(torch.equal(self.depths, torch.arange(1, self.num_nodes + 1, device=self.depths.device)))

    def node_draft_probs(self, node: int) -> Tensor | None:
        """The distribution node was drawn from, or None for a point mass."""
        if self.draft_probs is None or (self.point_mass is not None and bool(self.point_mass[node])):
            return None
        return self.draft_probs[node]

    def ancestors(self) -> Tensor:  # bool [N+1, N+1] over rows (0 = root): [r, c] = c is r or an ancestor of r
        if self._ancestors is None:
            self._ancestors = tree_ancestors(self.parents)
        return self._ancestors

    def attention_mask(self) -> Tensor:  # bool [N+1, N+1], local query indices (0 = root)
        """Row r may attend to local query token c iff c is r itself or one of its ancestors.

        This is AttentionMetadata.tree_mask for one sequence whose query tokens are [root, nodes...].
        """
        return self.ancestors()

    def row_depths(self) -> Tensor:  # int64 [N+1] over [root, nodes...]
        return F.pad(self.depths, (1, 0), value=0)

    def positions(self, root_position: int) -> Tensor:  # int64 [N+1]
        """Positions of [root, nodes...]: siblings share a position, each node one past its parent."""
        return self.row_depths() + root_position

    def _paths(self, nodes: Tensor) -> Tensor:  # int64 [L] -> [L, max_depth], -1 padded
        """Root-to-node paths: a node's ancestors in id order are its path (parents precede children)."""
        on_path = self.ancestors()[nodes + 1, 1:]  # [L, N]
        ids = torch.where(on_path, torch.arange(self.num_nodes, device=on_path.device), self.num_nodes)
        ids = ids.sort(dim=-1).values[:, : self.max_depth]
        return torch.where(ids == self.num_nodes, -1, ids)

    def path_to(self, node: int) -> list[int]:
        """Node ids from the root's child down to node (empty for node == -1, the root)."""
        if node == -1:
            return []
        return [n for n in self._paths(torch.tensor([node]))[0].tolist() if n >= 0]

    def leaves(self) -> list[int]:
        return self._leaf_ids().tolist()

    def _leaf_ids(self) -> Tensor:  # int64 [L]
        has_child = torch.zeros(self.num_nodes + 1, dtype=torch.bool, device=self.parents.device)
        has_child[self.parents + 1] = True
        return (~has_child[1:]).nonzero()[:, 0]

    def retrieve_indices(self) -> Tensor:  # int64 [num_leaves, max_depth], -1 padded
        """Every root-to-leaf path as node ids (Medusa's retrieve indices)."""
        return self._paths(self._leaf_ids())


@dataclass(frozen=True)
class TreeShape:
    """A static tree shape in Medusa's "choices" form: node = the path of candidate ranks from the root.

    Path (0, 1) is the 2nd-ranked candidate at depth 2 below the top candidate at depth 1.
    Nodes are ordered by depth, then lexicographically, so parents precede children.
    """

    paths: tuple[tuple[int, ...], ...]
    parents: tuple[int, ...]
    ranks: tuple[int, ...]  # last element of each path: which top-k candidate of its depth/parent

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]], max_nodes: int | None = None) -> TreeShape:
        ordered = sorted({tuple(int(c) for c in path) for path in paths}, key=lambda p: (len(p), p))
        check_node_budget(len(ordered), max_nodes, "tree shape")
        index = {path: i for i, path in enumerate(ordered)}
        parents = []
        for path in ordered:
            if not path or min(path) < 0:
                raise ValueError(f"tree path {path} must be a non-empty tuple of ranks >= 0")
            if len(path) > 1 and path[:-1] not in index:
                raise ValueError(f"tree path {path} has no parent path {path[:-1]} in the shape")
            parents.append(index[path[:-1]] if len(path) > 1 else -1)
        return cls(tuple(ordered), tuple(parents), tuple(path[-1] for path in ordered))

    @classmethod
    def from_branching(cls, branching: Sequence[int], max_nodes: int | None = None) -> TreeShape:
        """Full tree with branching[d] children under every node at depth d (branching[0] under the root)."""
        if not branching or min(branching) <= 0:
            raise ValueError(f"tree branching must be a non-empty list of positive ints, got {list(branching)}")
        total = sum(math.prod(branching[: d + 1]) for d in range(len(branching)))
        check_node_budget(total, max_nodes, "tree shape")
        paths: list[tuple[int, ...]] = []
        frontier: list[tuple[int, ...]] = [()]
        for width in branching:
            frontier = [path + (rank,) for path in frontier for rank in range(width)]
            paths.extend(frontier)
        return cls.from_paths(paths)

    @property
    def num_nodes(self) -> int:
        return len(self.paths)

    @property
    def max_depth(self) -> int:
        return max((len(p) for p in self.paths), default=0)

    @property
    def max_rank(self) -> int:
        """How many candidates per depth the shape needs (top-k with k = max_rank)."""
        return max(self.ranks, default=-1) + 1

    @cached_property
    def _geometry(self) -> DraftTree:
        """The shape's geometry, computed and validated once; every fill shares it."""
        tree = DraftTree(torch.zeros(self.num_nodes, dtype=torch.int64), list(self.parents))
        tree.ancestors()
        return tree

    def fill(self, tokens: Tensor | Sequence[int], draft_probs: Tensor | None = None) -> DraftTree:
        tokens = torch.as_tensor(tokens, dtype=torch.int64)
        if tokens.shape != (self.num_nodes,):
            raise ValueError(f"tree shape has {self.num_nodes} nodes but got tokens of shape {tuple(tokens.shape)}")
        geo = self._geometry
        tree = DraftTree._trusted(tokens, geo.parents.to(tokens.device), geo.depths.to(tokens.device), draft_probs,
                                  ancestors=geo.ancestors().to(tokens.device))
        tree._check_probs(self.num_nodes)
        return tree

    @cached_property
    def _medusa_index(self) -> tuple[Tensor, Tensor]:  # (head, rank) of every node, int64 [N] each
        return (torch.tensor([len(p) - 1 for p in self.paths], dtype=torch.int64),
                torch.tensor(self.ranks, dtype=torch.int64))

    def fill_medusa(self, topk_tokens: Tensor) -> DraftTree:  # topk_tokens int64 [num_heads, k]
        """Medusa: node at depth d with rank c gets head (d-1)'s c-th candidate; point masses."""
        if topk_tokens.dim() != 2 or topk_tokens.shape[0] < self.max_depth or topk_tokens.shape[1] < self.max_rank:
            raise ValueError(
                f"topk_tokens shape {tuple(topk_tokens.shape)} too small for a tree of depth "
                f"{self.max_depth} needing {self.max_rank} candidates per head"
            )
        depth_index, rank_index = self._medusa_index
        return self.fill(topk_tokens[depth_index.to(topk_tokens.device), rank_index.to(topk_tokens.device)])
