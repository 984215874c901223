"""Tree geometry from a parent array, vectorised: depths and ancestor matrices by pointer doubling.

Rows are [root, node 0, ..., node N-1] (row i + 1 = node i); parents[i] == -1 is the root and
parents[i] < i. Batched over any leading dimensions. serve_eval.speculative.tree.DraftTree caches these
for one tree; the verifiers call them on padded batches.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def _parent_rows(parents: Tensor) -> Tensor:  # int64 [B, N] -> [B, N+1]
    """Row pointers over [root, nodes...]: row i + 1 points at its parent's row, the root at itself."""
    return F.pad(parents + 1, (1, 0), value=0)


def _num_jumps(num_nodes: int) -> int:
    """Pointer-doubling rounds that cover any depth <= num_nodes (2**rounds > num_nodes)."""
    return max(1, num_nodes.bit_length())


def tree_depths(parents: Tensor) -> Tensor:  # int64 [..., N] -> int64 [..., N], root's children at 1
    """Depth of every node, by pointer jumping: log2(N) gathers, no per-node loop.

    Invariant: dist[r] is the number of edges from row r up to row ptr[r]; the root row points at itself
    with distance 0, so once every pointer has reached it, dist is the depth.
    """
    shape, n = parents.shape, parents.shape[-1]
    ptr = _parent_rows(parents.reshape(math.prod(shape[:-1]), n))  # [B, N+1]
    dist = (torch.arange(n + 1, device=parents.device) > 0).long().expand_as(ptr)
    for _ in range(_num_jumps(n)):
        dist = dist + dist.gather(1, ptr)
        ptr = ptr.gather(1, ptr)
    return dist[:, 1:].reshape(shape)


def tree_ancestors(parents: Tensor) -> Tensor:  # int64 [..., N] -> bool [..., N+1, N+1] over rows (0 = root)
    """[r, c] = row c is row r or one of its ancestors, by pointer doubling (log2(N) row gathers).

    After round k, anc[r] holds every row within 2**k edges above r and ptr[r] the 2**k-th ancestor
    (clamped at the root), so anc[r] | anc[ptr[r]] doubles the reach.
    """
    shape, n = parents.shape, parents.shape[-1]
    ptr = _parent_rows(parents.reshape(math.prod(shape[:-1]), n))  # [B, N+1]
    eye = torch.eye(n + 1, dtype=torch.bool, device=parents.device)
    anc = eye | F.one_hot(ptr, n + 1).bool()  # [B, N+1, N+1]
    for _ in range(_num_jumps(n)):
        anc = anc | anc.gather(1, ptr[:, :, None].expand(-1, -1, n + 1))
        ptr = ptr.gather(1, ptr)
    return anc.reshape(*shape[:-1], n + 1, n + 1)
