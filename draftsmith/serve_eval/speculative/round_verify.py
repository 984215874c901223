"""One step's verification: the target's logits rows of every speculating sequence -> accepted tokens.

Greedy sequences (temperature 0) are verified from argmaxes alone: no probabilities are computed for
them (logits_to_probs would turn each of their rows into a one-hot at that same argmax). Chains all sampled
at a plain temperature (no top-k / top-p) on fp32 CPU logits are verified in C (kernels.native_sampling:
the closed form's rules and uniforms, the softmax only of the rows the tests reach). Other sampling
sequences get `logits_to_probs` on their own verified rows only, with their parameters repeated per row
by tensor ops, then the exact verifier (closed form for chains, the general one for trees).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from draftsmith.kernels.native_sampling import verify_plain_chains
from draftsmith.kernels.row_ops import argmax_rows
from draftsmith.kernels.sampling import logits_to_probs
from draftsmith.serve_eval.speculative.tree import DraftTree
from draftsmith.serve_eval.speculative.verify import VerifyResult, verify_batch
from draftsmith.serve_eval.speculative.verify_fast import greedy_tree_paths, sampled_chain_accept


@dataclass
class SpecDraft:
    """One sequence's draft as verified this step (a chain is a DraftTree with parents i - 1)."""

    index: int  # position in the scheduled batch
    tree: DraftTree
    is_tree: bool  # proposed as a tree: its rows need an ancestor mask and positions by depth

    @property
    def num_nodes(self) -> int:
        return self.tree.num_nodes


@dataclass
class RoundOutcome:
    results: dict[int, VerifyResult]  # by batch index
    # Per verified group of trees (greedy, sampled): batch indices [B] and accepted node ids [B, D], -1
    # padded. Chains are left out: their accepted nodes already sit in their depth's slot.
    accepted: list[tuple[Tensor, Tensor]]


class _Packed:
    """A group of drafts padded to one width. Only what every path needs is built eagerly (a few small
    tensor ops per round count at batch 1); parents and the valid-row mask are built on first use."""

    def __init__(self, ids: list[int], drafts: dict[int, SpecDraft], root_rows: dict[int, int], device) -> None:
        self.ids = ids  # batch indices, in row order
        self.trees = [drafts[i].tree for i in ids]
        self.counts = [t.num_nodes for t in self.trees]  # nodes per draft
        self.chains = not any(drafts[i].is_tree for i in ids)
        self.device = device
        self.width = max(self.counts)
        self.padded = min(self.counts) != self.width
        self.starts = [root_rows[i] for i in ids]  # logits row of each draft's root; its nodes follow

    @cached_property
    def tokens(self) -> Tensor:  # int64 [B, N]
        trees = self.trees
        return (trees[0].tokens[None] if len(trees) == 1 else
                pad_sequence([t.tokens for t in trees], batch_first=True)).to(self.device)

    @cached_property
    def num_nodes(self) -> Tensor:  # int64 [B]
        return torch.tensor(self.counts, dtype=torch.int64, device=self.device)

    @cached_property
    def rows(self) -> Tensor:  # int64 [B, N+1]: logits row of [root, nodes...]
        local = torch.arange(self.width + 1, device=self.device)[None, :]
        if self.padded:  # padding rows repeat each draft's last row (any valid row would do)
            local = torch.minimum(local, self.num_nodes[:, None])
        return torch.tensor(self.starts, dtype=torch.int64, device=self.device)[:, None] + local

    def gather_rows(self, values: Tensor) -> Tensor:  # [R, ...] per logits row -> [B, N+1, ...]
        if len(self.ids) == 1:  # one draft: its rows are one contiguous slice, a view
            return values[self.starts[0]:self.starts[0] + self.width + 1][None]
        return values[self.rows]

    @cached_property
    def parents(self) -> Tensor:  # int64 [B, N]
        if self.chains:  # padding keeps the chain shape, so the verifier's chain test holds for the whole row
            return (torch.arange(self.width, device=self.device) - 1).expand(len(self.ids), self.width)
        return pad_sequence([t.parents for t in self.trees], batch_first=True, padding_value=-1).to(self.device)

    @cached_property
    def valid_rows(self) -> Tensor:  # bool [B, N+1]
        return torch.arange(self.width + 1, device=self.device)[None, :] <= self.num_nodes[:, None]


def _stacked_ancestors(trees: list[DraftTree], width: int) -> Tensor:  # bool [B, N+1, N+1]
    """The trees' cached ancestor matrices (built once for the attention mask), padded to one width."""
    if len(trees) == 1:
        return trees[0].ancestors()[None]
    out = torch.zeros(len(trees), width + 1, width + 1, dtype=torch.bool)
    for b, tree in enumerate(trees):
        n = tree.num_nodes + 1
        out[b, :n, :n] = tree.ancestors()
    return out


def _greedy(logits_argmax: Tensor, packed: _Packed, drafts: dict[int, SpecDraft]) -> tuple[list, Tensor | None]:
    """-> per draft (emitted tokens, accepted count, accepted node ids), and accepted nodes [B, D] for trees."""
    if packed.chains:
        return _greedy_chains(logits_argmax.tolist(), packed), None   # accepted nodes already sit at their depth
    target_argmax = packed.gather_rows(logits_argmax)  # [B, N+1]
    ancestors = _stacked_ancestors(packed.trees, packed.width).to(packed.tokens.device)
    valid = packed.valid_rows[:, 1:] if packed.padded else None
    num_accepted, path = greedy_tree_paths(packed.tokens, packed.parents, target_argmax, ancestors, valid)
    out = []
    for count, ids, tokens, argmax in zip(num_accepted.tolist(), path.tolist(), packed.tokens.tolist(),
                                          target_argmax.tolist()):
        ids = ids[:count]  # per draft: its path, its tokens, then the argmax of the last accepted row
        out.append(([tokens[n] for n in ids] + [argmax[ids[-1] + 1 if ids else 0]], count, ids))
    width = path.shape[1]
    return out, torch.where(path < width, path, -1)


def _greedy_chains(argmax: list[int], packed: _Packed) -> list:
    """Each chain's leading run of tokens equal to the argmax of the row before them, then the argmax after the
    run. In Python over the rows' argmaxes (one list): a chain's K compares cost less than the padding, gather,
    cumprod and reads back that the same test takes in tensor ops (verify_fast.greedy_chain_accepted)."""
    out = []
    for tree, root in zip(packed.trees, packed.starts):
        tokens = tree.tokens.tolist()
        count = 0
        while count < len(tokens) and tokens[count] == argmax[root + count]:
            count += 1
        out.append((tokens[:count] + [argmax[root + count]], count, list(range(count))))
    return out


def _rows(tokens: Tensor, num_accepted: Tensor, nodes: Tensor) -> list:
    return [(row[: count + 1], count, path[:count])
            for row, count, path in zip(tokens.tolist(), num_accepted.tolist(), nodes.tolist())]


def _draft_rows(packed: _Packed, seqs: Sequence, vocab: int, device) -> tuple[Tensor | None, Tensor | None]:
    """The drafts' rows [B, N, V] (fp32) and point-mass flags [B, N]; (None, None) when every draft is a point mass.
    One draft with rows and no point masses: its own rows, no copy or zero fill."""
    trees = packed.trees
    for i, tree in zip(packed.ids, trees):
        if tree.draft_probs is not None and tree.draft_probs.shape[-1] != vocab:
            raise ValueError(f"draft_probs vocab {tree.draft_probs.shape[-1]} != target vocab {vocab} "
                             f"(request {seqs[i].request_id!r})")
    if len(trees) == 1 and trees[0].draft_probs is not None and trees[0].point_mass is None:
        return trees[0].draft_probs.to(device, torch.float32)[None], None
    if all(t.draft_probs is None for t in trees):
        return None, None
    batch, width = len(trees), packed.width
    draft_probs = torch.zeros(batch, width, vocab, device=device)
    point_mass = torch.ones(batch, width, dtype=torch.bool, device=device)
    for b, tree in enumerate(trees):
        if tree.draft_probs is not None:
            n = tree.num_nodes
            draft_probs[b, :n] = tree.draft_probs.to(device, torch.float32)
            point_mass[b, :n] = False if tree.point_mass is None else tree.point_mass.to(device)
    return draft_probs, point_mass


def _plain_chains(logits: Tensor, packed: _Packed, seqs: Sequence, generators: list,
                  draft_rows: tuple[Tensor | None, Tensor | None]):
    """Chains all sampled at a plain temperature: verified in C from the logits (kernels.native_sampling), or None."""
    if not packed.chains:
        return None
    verified = verify_plain_chains(logits, packed.starts, packed.tokens, packed.counts, *draft_rows,
                                   [seqs[i].params for i in packed.ids], [generators[i] for i in packed.ids])
    if verified is None:
        return None
    tokens, num_accepted = verified
    nodes = torch.arange(packed.width)[None].expand(len(packed.trees), -1)
    return _rows(tokens, num_accepted, torch.where(nodes < num_accepted[:, None], nodes, -1)), None


def _sampled(logits: Tensor, packed: _Packed, drafts: dict[int, SpecDraft], seqs: Sequence, generators: list):
    dev, vocab = logits.device, logits.shape[1]
    draft_probs, point_mass = _draft_rows(packed, seqs, vocab, dev)
    fast = _plain_chains(logits, packed, seqs, generators, (draft_probs, point_mass))
    if fast is not None:
        return fast
    per_row = packed.num_nodes + 1  # verified rows per sequence
    params = [seqs[i].params for i in packed.ids]

    def repeat(values, dtype):
        return torch.tensor(values, dtype=dtype, device=dev).repeat_interleave(per_row)

    flat_rows = packed.rows[packed.valid_rows] if packed.padded else packed.rows.flatten()
    probs = logits_to_probs(logits.index_select(0, flat_rows), repeat([p.temperature for p in params], torch.float32),
                            repeat([p.top_k for p in params], torch.int64),
                            repeat([p.top_p for p in params], torch.float32))
    batch, width = packed.tokens.shape
    if packed.padded:
        target = probs.new_zeros(batch, width + 1, vocab)
        target[packed.valid_rows] = probs
    else:
        target = probs.view(batch, width + 1, vocab)
    gens = [generators[i] for i in packed.ids]
    if packed.chains:
        found = sampled_chain_accept(packed.tokens, target, gens, draft_probs, point_mass, packed.num_nodes)
        return _rows(*found), None
    out = verify_batch(packed.tokens, packed.parents, target, False, gens, draft_probs, point_mass, packed.num_nodes)
    return _rows(out.tokens, out.num_accepted, out.accepted_nodes), out.accepted_nodes


def verify_round(
    logits: Tensor,  # [R, V] fp32 logits rows of the forward
    root_rows: dict[int, int],  # batch index -> logits row of its root (its nodes follow)
    drafts: dict[int, SpecDraft],  # batch index -> draft
    seqs: Sequence,  # the scheduled sequences (params, request_id)
    generators: list,  # per batch index: the generator its samples come from
) -> RoundOutcome:
    greedy_ids = [i for i in sorted(drafts) if seqs[i].params.temperature == 0]
    sampled_ids = [i for i in sorted(drafts) if seqs[i].params.temperature != 0]
    results: dict[int, VerifyResult] = {}
    accepted = []
    logits_argmax = argmax_rows(logits) if greedy_ids else None  # [R]: one pass, no row copies
    for ids in (greedy_ids, sampled_ids):
        if not ids:
            continue
        packed = _Packed(ids, drafts, root_rows, logits.device)
        if ids is greedy_ids:
            rows, nodes = _greedy(logits_argmax, packed, drafts)
        else:
            rows, nodes = _sampled(logits, packed, drafts, seqs, generators)
        results.update((i, VerifyResult(*row)) for i, row in zip(ids, rows))
        if nodes is not None:
            accepted.append((torch.tensor(ids, dtype=torch.int64), nodes))
    return RoundOutcome(results, accepted)
