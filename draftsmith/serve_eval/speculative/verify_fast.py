"""Closed-form verification for the two common cases, with no loop over depths or children.

- greedy (T = 0), chains and trees: only the target's argmax per row is needed, never a probability;
  a node is accepted iff its token is its parent row's argmax, it is the first such child of that parent
  (node order breaks ties, as in the general verifier) and every ancestor is accepted as well.
- sampled chains: each node has one child, so the residual is reset to the target's row after every
  acceptance; the acceptance tests of all K nodes are independent given their uniforms and are evaluated
  at once, the first rejection fixes the emitted prefix, and only that one row's residual is built.

Both give exactly what serve_eval.speculative.verify.verify_reference gives, draw for draw: the same uniforms
(row b draws num_nodes[b] from its own generator, none when greedy) and one residual / bonus sample per
row from its generator (tests/test_verify_fast.py compares them token for token).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from draftsmith.kernels.sampling import GeneratorArg, sample, uniforms
from draftsmith.serve_eval.speculative.tree import tree_ancestors


def _valid(num_nodes: Tensor | None, batch: int, width: int, device) -> tuple[Tensor, Tensor]:
    if num_nodes is None:
        num_nodes = torch.full((batch,), width, dtype=torch.int64, device=device)
    return num_nodes, torch.arange(width, device=device)[None, :] < num_nodes[:, None]  # [B], bool [B, N]


def greedy_chain_accepted(
    tokens: Tensor,  # int64 [B, K]
    target_argmax: Tensor,  # int64 [B, K+1], row 0 = root
    valid: Tensor | None = None,  # bool [B, K]; None = no padding
) -> Tensor:  # int64 [B]
    """Greedy chains: accepted drafts = the leading run of matches with the previous row's argmax."""
    match = tokens == target_argmax[:, :-1]
    if valid is not None:
        match &= valid
    return match.cumprod(dim=1).sum(dim=1)


def greedy_chain_counts(
    tokens: Tensor,  # int64 [B, K]
    target_argmax: Tensor,  # int64 [B, K+1], row 0 = root
    valid: Tensor | None = None,  # bool [B, K]; None = no padding
) -> tuple[Tensor, Tensor]:  # num_accepted [B], bonus / correction token [B]
    num_accepted = greedy_chain_accepted(tokens, target_argmax, valid)
    return num_accepted, target_argmax.gather(1, num_accepted[:, None])[:, 0]


def greedy_accept(
    tokens: Tensor,  # int64 [B, N]
    parents: Tensor,  # int64 [B, N], -1 = root
    target_argmax: Tensor,  # int64 [B, N+1], row 0 = root
    num_nodes: Tensor | None = None,  # int64 [B]
    chains: bool = False,  # every row is a chain (parents[b, i] = i - 1): a cumulative product suffices
    ancestors: Tensor | None = None,  # bool [B, N+1, N+1] when the caller has them (DraftTree caches them)
) -> tuple[Tensor, Tensor, Tensor]:  # tokens [B, D+1] (-1 padded), num_accepted [B], accepted_nodes [B, D]
    """Greedy verification from argmaxes alone (see module docstring)."""
    batch, width = tokens.shape
    num_nodes, valid = _valid(num_nodes, batch, width, tokens.device)
    if chains:
        num_accepted, bonus = greedy_chain_counts(tokens, target_argmax, valid)
        accepted = torch.arange(width, device=tokens.device)[None, :] < num_accepted[:, None]
        out = torch.cat([torch.where(accepted, tokens, -1), torch.full_like(bonus[:, None], -1)], 1)
        nodes = torch.where(accepted, torch.arange(width, device=tokens.device), -1)
        return out.scatter_(1, num_accepted[:, None], bonus[:, None]), num_accepted, nodes
    ancestors = tree_ancestors(parents) if ancestors is None else ancestors  # [B, N+1, N+1]
    num_accepted, path = greedy_tree_paths(tokens, parents, target_argmax, ancestors, valid)
    on = path < width
    nodes = torch.where(on, path, -1)
    out = torch.where(on, tokens.gather(1, path.clamp_max(max(width - 1, 0))), -1)
    bonus = target_argmax.gather(1, nodes.amax(dim=1, keepdim=True) + 1 if width else num_accepted[:, None])
    out = torch.cat([out, torch.full_like(bonus, -1)], 1).scatter_(1, num_accepted[:, None], bonus)
    # Same widths as the general verifier: D = the deepest valid node (a node's depth is its number of
    # ancestor-or-self rows, the root excluded).
    depth = int(ancestors[:, 1:, 1:].sum(dim=-1).masked_fill(~valid, 0).max()) if width else 0
    return out[:, : depth + 1], num_accepted, nodes[:, :depth]


def greedy_tree_paths(
    tokens: Tensor,  # int64 [B, N]
    parents: Tensor,  # int64 [B, N], -1 = root
    target_argmax: Tensor,  # int64 [B, N+1], row 0 = root
    ancestors: Tensor,  # bool [B, N+1, N+1] over rows (0 = root)
    valid: Tensor | None = None,  # bool [B, N]; None = no padding
) -> tuple[Tensor, Tensor]:  # num_accepted [B], path [B, N]: accepted node ids in depth order, then N
    """The greedy path of each tree: a node is good when its token is its parent row's argmax and it is
    the first such child (all good siblings share that token, so the lowest id wins); it is accepted
    when every ancestor-or-self is good. The accepted ids increase with depth (parents precede
    children), so sorting them lists the path in depth order."""
    batch, width = tokens.shape
    parent_rows = parents + 1
    match = tokens == target_argmax.gather(1, parent_rows)  # [B, N]
    if valid is not None:
        match &= valid
    node_ids = torch.arange(width, device=tokens.device).expand(batch, width)
    candidate = torch.where(match, node_ids, width)
    first = candidate.new_full((batch, width + 1), width).scatter_reduce_(1, parent_rows, candidate, "amin")
    good_rows = F.pad(match & (candidate == first.gather(1, parent_rows)), (1, 0), value=True)  # [B, N+1]
    on_path = ~(ancestors[:, 1:] & ~good_rows[:, None, :]).any(dim=-1)  # [B, N]
    if valid is not None:  # padding rows of the ancestor matrix may be empty, hence "on every path"
        on_path &= valid
    path = torch.where(on_path, node_ids, width).sort(dim=1).values
    return on_path.sum(dim=1), path


def sampled_chain_accept(
    tokens: Tensor,  # int64 [B, K]
    target_probs: Tensor,  # [B, K+1, V]
    generators: GeneratorArg = None,
    draft_probs: Tensor | None = None,  # [B, K, V]; None = point masses
    point_mass: Tensor | None = None,  # bool [B, K]
    num_nodes: Tensor | None = None,  # int64 [B]
) -> tuple[Tensor, Tensor, Tensor]:  # tokens [B, K+1] (-1 padded), num_accepted [B], accepted_nodes [B, K]
    """Exact rejection sampling of B chains in one pass (see module docstring)."""
    batch, width = tokens.shape
    device = tokens.device
    num_nodes, valid = _valid(num_nodes, batch, width, device)
    u = uniforms(num_nodes.tolist(), batch, generators, device)  # [B, <=K] float64
    u = F.pad(u, (0, width - u.shape[1]), value=1.0)
    p_x = target_probs[:, :width].gather(2, tokens[:, :, None])[..., 0].double()  # [B, K]
    dense = draft_probs is not None
    if dense:
        q_x = draft_probs.gather(2, tokens[:, :, None])[..., 0].double()
        if point_mass is not None:
            q_x = torch.where(point_mass, 1.0, q_x)
    else:
        q_x = torch.ones_like(p_x)
    accepted = (valid & (u * q_x < p_x)).long().cumprod(dim=1)  # [B, K]
    num_accepted = accepted.sum(dim=1)
    rows = torch.arange(batch, device=device)
    residual = target_probs[rows, num_accepted].double()  # [B, V]: the stop row (bonus row when all accepted)
    rejected = num_accepted < num_nodes
    if bool(rejected.any()):
        at = num_accepted.clamp_max(width - 1)
        x = tokens[rows, at]
        if dense:
            q_row = draft_probs[rows, at].double()
            if point_mass is not None:
                q_row = torch.where(point_mass[rows, at][:, None], F.one_hot(x, residual.shape[1]).double(), q_row)
            new = (residual - q_row).clamp_min(0.0)
        else:  # r - one_hot(x), clamped at 0, is r with its x entry zeroed (r(x) <= 1)
            new = residual.clone()
            new[rows, x] = 0.0
        mass = new.sum(dim=-1, keepdim=True)
        # A residual is all zero only when r == q, where rejection has probability 0: keep r then.
        fixed = torch.where(mass > 0, new / mass.clamp_min(1e-300), residual)
        residual = torch.where(rejected[:, None], fixed, residual)
    final = sample(residual, generators)
    nodes = torch.where(accepted.bool(), torch.arange(width, device=device), -1)
    out = torch.cat([torch.where(accepted.bool(), tokens, -1), torch.full((batch, 1), -1, device=device,
                                                                          dtype=torch.int64)], 1)
    return out.scatter_(1, num_accepted[:, None], final[:, None]), num_accepted, nodes
