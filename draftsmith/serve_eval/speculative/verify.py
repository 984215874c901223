"""Speculative verification: greedy and exact rejection sampling, for chains and trees.

One algorithm serves everything: a chain of K drafts is the tree where each node has one child.
At a node (the root first) with target distribution p, the children are tried in order:

- greedy: accept the first child whose token is argmax p; if none, emit argmax p and stop;
- sampling (SpecInfer's recursive rejection sampling): with residual r = p, child i with token x_i
  drawn from draft distribution q_i (a point mass when the draft chose it deterministically) is
  accepted with probability min(1, r(x_i) / q_i(x_i)); on rejection r <- norm(max(0, r - q_i)).
  If every child is rejected, sample from r and stop.
Accepting a child moves to it, with r reset to the target distribution at that node; reaching a
leaf (all drafts accepted) emits a bonus token drawn from the leaf's target distribution.

Sibling draws must be independent given the context (i.i.d. samples, or deterministic top-k
point masses); then each emitted token is distributed exactly as the target's (Leviathan et al.
for one child; Miao et al., SpecInfer, for siblings). The tests check this statistically.

Numerics: probabilities are promoted to float64 and each draft node owns one float64 uniform u;
"accept" is `u * q(x) < r(x)`, which needs no division (q(x) = 0 cannot happen for a token drawn
from q; if a proposer hands one in anyway, it is accepted iff r(x) > 0). A residual can only be all
zero when r == q, where rejection has probability 0; the guard keeps r then.

Randomness: row b draws exactly num_nodes[b] uniforms (sampling rows only) plus one residual or
bonus sample from its own generator, so a seeded request's stream does not depend on its batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from draftsmith.kernels.sampling import GeneratorArg, sample, uniforms
from draftsmith.serve_eval.speculative.tree import DraftTree, tree_depths
from draftsmith.serve_eval.speculative.verify_fast import greedy_accept, sampled_chain_accept


class VerifyResult(NamedTuple):
    accepted_tokens: list[int]  # emitted tokens: accepted drafts, then the correction / bonus token
    num_accepted_drafts: int
    accepted_node_ids: list[int]  # node ids along the accepted path (chain: 0..n-1)


class BatchVerifyOutput(NamedTuple):
    tokens: Tensor  # int64 [B, D+1], emitted tokens, -1 padded; row b emits num_accepted[b] + 1
    num_accepted: Tensor  # int64 [B], accepted draft tokens
    accepted_nodes: Tensor  # int64 [B, D], node ids of the accepted path, -1 padded

    def to_results(self) -> list[VerifyResult]:
        results = []
        for tokens, count, nodes in zip(self.tokens.tolist(), self.num_accepted.tolist(), self.accepted_nodes.tolist()):
            results.append(VerifyResult(tokens[: count + 1], count, nodes[:count]))
        return results


def _select_generators(generators: GeneratorArg, rows: Tensor) -> GeneratorArg:
    if generators is None or isinstance(generators, torch.Generator):
        return generators
    return [generators[i] for i in rows.tolist()]


def _children_table(parents: Tensor, valid: Tensor) -> Tensor:  # int64 [B, N+1, max_branch], -1 padded
    """children[b, r, j] = node id of the j-th child (in node order) of row r (0 = root, i+1 = node i)."""
    batch, num_nodes = parents.shape
    parent_row = torch.where(valid, parents + 1, torch.full_like(parents, num_nodes + 1))  # N+1: padding bin
    one_hot = F.one_hot(parent_row, num_nodes + 2)  # [B, N, N+2]
    slot = (one_hot.cumsum(dim=1) * one_hot).sum(-1) - 1  # rank among earlier siblings
    max_branch = int(slot[valid].max()) + 1 if bool(valid.any()) else 0
    children = torch.full((batch, num_nodes + 2, max(max_branch, 1)), -1, dtype=torch.int64, device=parents.device)
    b_index = torch.arange(batch, device=parents.device)[:, None].expand(batch, num_nodes)
    node_ids = torch.arange(num_nodes, device=parents.device)[None, :].expand(batch, num_nodes)
    children[b_index[valid], parent_row[valid], slot[valid]] = node_ids[valid]
    return children[:, : num_nodes + 1, :max_branch]


def _check_inputs(tokens: Tensor, parents: Tensor, target_probs: Tensor, draft_probs: Tensor | None) -> None:
    if tokens.dim() != 2 or parents.shape != tokens.shape:
        raise ValueError(f"tokens shape {tuple(tokens.shape)} and parents shape {tuple(parents.shape)} must be [B, N]")
    batch, max_nodes = tokens.shape
    if target_probs.dim() != 3 or target_probs.shape[:2] != (batch, max_nodes + 1):
        raise ValueError(
            f"target_probs shape {tuple(target_probs.shape)} does not match {batch} trees of "
            f"{max_nodes} nodes (expected [{batch}, {max_nodes + 1}, V])"
        )
    vocab_size = target_probs.shape[2]
    if draft_probs is not None and draft_probs.shape != (batch, max_nodes, vocab_size):
        raise ValueError(
            f"draft_probs shape {tuple(draft_probs.shape)} does not match target_probs shape "
            f"{tuple(target_probs.shape)} (expected [{batch}, {max_nodes}, {vocab_size}])"
        )


def _greedy_rows(greedy, batch: int, device) -> Tensor:  # bool [B]
    greedy = torch.as_tensor(greedy, dtype=torch.bool, device=device)
    if greedy.dim() == 0:
        return greedy.expand(batch)
    if greedy.shape != (batch,):
        raise ValueError(f"greedy has shape {tuple(greedy.shape)} but there are {batch} trees")
    return greedy


def is_chain(parents: Tensor) -> bool:  # parents int64 [B, N]
    """Every row is a chain: node i's parent is node i - 1."""
    return bool(torch.equal(parents, (torch.arange(parents.shape[1], device=parents.device) - 1).expand_as(parents)))


def verify_batch(
    tokens: Tensor,  # int64 [B, N] draft tokens per node
    parents: Tensor,  # int64 [B, N], -1 = root, parents[b, i] < i
    target_probs: Tensor,  # [B, N+1, V]; row 0 = root, row i+1 = node i
    greedy: bool | Sequence[bool] | Tensor,  # [B]
    generators: GeneratorArg = None,  # per row, one for all rows, or None
    draft_probs: Tensor | None = None,  # [B, N, V]; None = every node is a point mass
    point_mass: Tensor | None = None,  # bool [B, N]: rows of draft_probs to treat as point masses
    num_nodes: Tensor | None = None,  # int64 [B]; nodes >= num_nodes[b] are padding
) -> BatchVerifyOutput:
    """Verify B draft trees (chains included): all-greedy batches and all-sampled chains take the closed
    forms of serve_eval.speculative.verify_fast, everything else the general verify_reference (same results)."""
    _check_inputs(tokens, parents, target_probs, draft_probs)
    greedy = _greedy_rows(greedy, tokens.shape[0], tokens.device)
    if bool(greedy.all()):
        return BatchVerifyOutput(*greedy_accept(tokens, parents, target_probs.argmax(dim=-1), num_nodes,
                                                is_chain(parents)))
    if not bool(greedy.any()) and is_chain(parents):
        return BatchVerifyOutput(*sampled_chain_accept(tokens, target_probs, generators, draft_probs, point_mass,
                                                       num_nodes))
    return verify_reference(tokens, parents, target_probs, greedy, generators, draft_probs, point_mass, num_nodes)


class _TreeInputs(NamedTuple):
    tokens: Tensor  # int64 [B, N]
    children: Tensor  # int64 [B, N+1, max_branch], -1 padded
    draft_probs: Tensor | None  # [B, N, V]
    point_mass: Tensor  # bool [B, N]
    node_uniforms: Tensor  # float64 [B, N]
    greedy: Tensor  # bool [B]


def _try_children(
    inputs: _TreeInputs,
    rows: Tensor,  # int64 [A] active trees
    cur: Tensor,  # int64 [A] their current row
    residual: Tensor,  # float64 [A, V], updated in place on each rejection
    target_argmax: Tensor,  # int64 [A]
) -> Tensor:  # int64 [A]: the accepted child's node id, -1 when every child was rejected
    """Try the children of each active tree's current row in node order (see the module docstring)."""
    row_greedy = inputs.greedy[rows]
    chosen = torch.full_like(rows, -1)
    for j in range(inputs.children.shape[2]):
        child = inputs.children[rows, cur, j]
        trying = (child >= 0) & (chosen < 0)
        if not bool(trying.any()):
            continue
        safe_child = child.clamp_min(0)
        x = inputs.tokens[rows, safe_child]
        r_x = residual.gather(1, x[:, None])[:, 0]
        is_point = inputs.point_mass[rows, safe_child]
        if inputs.draft_probs is None:
            q_x = torch.ones_like(r_x)
        else:
            q_x = torch.where(is_point, 1.0, inputs.draft_probs[rows, safe_child, x].double())
        u = inputs.node_uniforms[rows, safe_child]
        accept = trying & torch.where(row_greedy, x == target_argmax, u * q_x < r_x)
        chosen = torch.where(accept, child, chosen)
        reject = (trying & ~accept & ~row_greedy).nonzero()[:, 0]
        if reject.numel():
            q_row = F.one_hot(x[reject], residual.shape[1]).double()
            if inputs.draft_probs is not None:
                q_dense = inputs.draft_probs[rows[reject], safe_child[reject]].double()
                q_row = torch.where(is_point[reject, None], q_row, q_dense)
            new = (residual[reject] - q_row).clamp_min(0.0)
            mass = new.sum(dim=-1, keepdim=True)
            residual[reject] = torch.where(mass > 0, new / mass.clamp_min(1e-300), residual[reject])
    return chosen


def _tree_inputs(tokens: Tensor, parents: Tensor, greedy: Tensor, generators: GeneratorArg,
                 draft_probs: Tensor | None, point_mass: Tensor | None,
                 num_nodes: Tensor | None) -> tuple[_TreeInputs, int]:
    """What the depth loop reads (children table, point masses, one uniform per sampled node), and the
    deepest valid node's depth. Row b draws num_nodes[b] uniforms when it samples, none when greedy."""
    batch, max_nodes = tokens.shape
    device = tokens.device
    if num_nodes is None:
        num_nodes = torch.full((batch,), max_nodes, dtype=torch.int64, device=device)
    valid = torch.arange(max_nodes, device=device)[None, :] < num_nodes[:, None]
    if point_mass is None:
        point_mass = torch.full((batch, max_nodes), draft_probs is None, dtype=torch.bool, device=device)
    max_depth = int(tree_depths(parents).masked_fill(~valid, 0).max()) if max_nodes else 0
    node_uniforms = uniforms(torch.where(greedy, 0, num_nodes).tolist(), batch, generators, device)
    if node_uniforms.shape[1] < max_nodes:  # greedy-only batches draw nothing
        node_uniforms = F.pad(node_uniforms, (0, max_nodes - node_uniforms.shape[1]), value=1.0)
    children = _children_table(parents, valid)
    return _TreeInputs(tokens, children, draft_probs, point_mass, node_uniforms, greedy), max_depth


def verify_reference(
    tokens: Tensor,  # int64 [B, N] draft tokens per node
    parents: Tensor,  # int64 [B, N], -1 = root, parents[b, i] < i
    target_probs: Tensor,  # [B, N+1, V]; row 0 = root, row i+1 = node i
    greedy: bool | Sequence[bool] | Tensor,  # [B]
    generators: GeneratorArg = None,  # per row, one for all rows, or None
    draft_probs: Tensor | None = None,  # [B, N, V]; None = every node is a point mass
    point_mass: Tensor | None = None,  # bool [B, N]: rows of draft_probs to treat as point masses
    num_nodes: Tensor | None = None,  # int64 [B]; nodes >= num_nodes[b] are padding
) -> BatchVerifyOutput:
    """The general algorithm of the module docstring, depth by depth, vectorized over the batch."""
    _check_inputs(tokens, parents, target_probs, draft_probs)
    batch, device = tokens.shape[0], tokens.device
    inputs, max_depth = _tree_inputs(tokens, parents, _greedy_rows(greedy, batch, device), generators,
                                     draft_probs, point_mass, num_nodes)
    greedy = inputs.greedy
    out_tokens = torch.full((batch, max_depth + 1), -1, dtype=torch.int64, device=device)
    accepted_nodes = torch.full((batch, max(max_depth, 0)), -1, dtype=torch.int64, device=device)
    num_accepted = torch.zeros(batch, dtype=torch.int64, device=device)
    current_row = torch.zeros(batch, dtype=torch.int64, device=device)
    active = torch.ones(batch, dtype=torch.bool, device=device)

    for step in range(max_depth + 1):
        rows = active.nonzero()[:, 0]
        if rows.numel() == 0:
            break
        cur = current_row[rows]
        residual = target_probs[rows, cur].double()  # [A, V]
        row_greedy = greedy[rows]
        target_argmax = residual.argmax(dim=-1)
        chosen = _try_children(inputs, rows, cur, residual, target_argmax)

        took = chosen >= 0
        if bool(took.any()):
            acc_rows, acc_nodes = rows[took], chosen[took]
            out_tokens[acc_rows, step] = tokens[acc_rows, acc_nodes]
            accepted_nodes[acc_rows, step] = acc_nodes
            num_accepted[acc_rows] += 1
            current_row[acc_rows] = acc_nodes + 1
        stop = ~took
        if bool(stop.any()):
            final = target_argmax.clone()
            sampled = stop & ~row_greedy
            if bool(sampled.any()):
                final[sampled] = sample(residual[sampled], _select_generators(generators, rows[sampled]))
            out_tokens[rows[stop], step] = final[stop]
            active[rows[stop]] = False
    return BatchVerifyOutput(out_tokens, num_accepted, accepted_nodes)


def verify_chains(
    draft_tokens: Tensor,  # int64 [B, K]
    target_probs: Tensor,  # [B, K+1, V]
    greedy: bool | Sequence[bool] | Tensor,
    generators: GeneratorArg = None,
    draft_probs: Tensor | None = None,  # [B, K, V] or None (point masses)
    num_drafts: Tensor | None = None,  # int64 [B]; K_b <= K, the rest is padding
) -> BatchVerifyOutput:
    """Batched chains: node i's parent is node i - 1."""
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be [B, K], got shape {tuple(draft_tokens.shape)}")
    batch, k = draft_tokens.shape
    parents = (torch.arange(k, device=draft_tokens.device) - 1).expand(batch, k)
    return verify_batch(draft_tokens, parents, target_probs, greedy, generators, draft_probs, None, num_drafts)


def verify_chain(
    draft_tokens: Tensor | Sequence[int],  # [K]
    draft_probs: Tensor | None,  # [K, V] or None (point masses, e.g. n-gram drafts)
    target_probs: Tensor,  # [K+1, V]
    greedy: bool,
    generator: torch.Generator | None = None,
) -> VerifyResult:
    draft_tokens = torch.as_tensor(draft_tokens, dtype=torch.int64, device=target_probs.device)
    k = draft_tokens.numel()
    if target_probs.dim() != 2 or target_probs.shape[0] != k + 1:
        raise ValueError(
            f"target_probs shape {tuple(target_probs.shape)} does not match {k} draft tokens (expected [{k + 1}, V])"
        )
    if draft_probs is not None and draft_probs.shape != (k, target_probs.shape[1]):
        raise ValueError(
            f"draft_probs shape {tuple(draft_probs.shape)} does not match target_probs shape "
            f"{tuple(target_probs.shape)} (expected [{k}, {target_probs.shape[1]}])"
        )
    out = verify_chains(
        draft_tokens[None], target_probs[None], greedy, generator, None if draft_probs is None else draft_probs[None]
    )
    return out.to_results()[0]


def verify_tree(
    tree: DraftTree,
    target_probs: Tensor,  # [N+1, V], row 0 = root
    greedy: bool,
    generator: torch.Generator | None = None,
) -> VerifyResult:
    return verify_trees([tree], [target_probs], [greedy], generator)[0]


def verify_trees(
    trees: Sequence[DraftTree],
    target_probs: Sequence[Tensor],  # each [N_b + 1, V]
    greedy: bool | Sequence[bool],
    generators: GeneratorArg = None,
) -> list[VerifyResult]:
    """Pad a batch of (possibly differently shaped) trees and verify them together."""
    if len(trees) != len(target_probs):
        raise ValueError(f"got {len(trees)} trees but {len(target_probs)} target_probs")
    batch = len(trees)
    if batch == 0:
        return []
    width = max(tree.num_nodes for tree in trees)
    vocab_size = target_probs[0].shape[-1]
    device = target_probs[0].device
    tokens = torch.zeros((batch, width), dtype=torch.int64, device=device)
    parents = torch.full((batch, width), -1, dtype=torch.int64, device=device)
    probs = torch.zeros((batch, width + 1, vocab_size), dtype=target_probs[0].dtype, device=device)
    any_dense = any(tree.draft_probs is not None for tree in trees)
    draft = torch.zeros((batch, width, vocab_size), device=device) if any_dense else None
    point_mass = torch.ones((batch, width), dtype=torch.bool, device=device)
    for b, (tree, target) in enumerate(zip(trees, target_probs)):
        n = tree.num_nodes
        if target.shape != (n + 1, vocab_size):
            raise ValueError(
                f"tree {b}: target_probs shape {tuple(target.shape)} does not match {n} nodes "
                f"(expected [{n + 1}, {vocab_size}])"
            )
        if tree.draft_probs is not None and tree.draft_probs.shape[1] != vocab_size:
            raise ValueError(
                f"tree {b}: draft_probs vocab {tree.draft_probs.shape[1]} != target_probs vocab {vocab_size}"
            )
        tokens[b, :n], parents[b, :n], probs[b, : n + 1] = tree.tokens, tree.parents, target
        if tree.draft_probs is not None:
            draft[b, :n] = tree.draft_probs
            point_mass[b, :n] = tree.point_mass if tree.point_mass is not None else False
    num_nodes = torch.tensor([tree.num_nodes for tree in trees], dtype=torch.int64, device=device)
    return verify_batch(tokens, parents, probs, greedy, generators, draft, point_mass, num_nodes).to_results()
