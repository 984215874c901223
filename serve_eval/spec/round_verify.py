"""One step's verification: the target's logits rows of every speculating sequence -> accepted tokens.

Greedy sequences (temperature 0) are verified from argmaxes alone: no probabilities are computed for
them (logits_to_probs would turn each of their rows into a one-hot at that same argmax). Sampling
sequences get `logits_to_probs` on their own verified rows only, with their parameters repeated per row
by tensor ops, then the exact verifier (closed form for chains, the general one for trees).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from kernels.sampling import logits_to_probs
from serve_eval.spec.tree import DraftTree
from serve_eval.spec.verify import VerifyResult, verify_batch
from serve_eval.spec.verify_fast import greedy_accept, greedy_chain_counts


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


@dataclass
class _Packed:
    ids: list[int]  # batch indices, in row order
    counts: list[int]  # nodes per draft
    tokens: Tensor  # int64 [B, N]
    parents: Tensor  # int64 [B, N]
    num_nodes: Tensor  # int64 [B]
    rows: Tensor  # int64 [B, N+1] logits row of [root, nodes...]; padding repeats the last row
    valid_rows: Tensor  # bool [B, N+1]
    chains: bool

    @property
    def padded(self) -> bool:
        return min(self.counts) != self.tokens.shape[1]


def _pack(ids: list[int], drafts: dict[int, SpecDraft], root_rows: dict[int, int], device) -> _Packed:
    trees = [drafts[i].tree for i in ids]
    counts = [t.num_nodes for t in trees]
    chains = not any(drafts[i].is_tree for i in ids)
    tokens = pad_sequence([t.tokens for t in trees], batch_first=True).to(device)
    width = tokens.shape[1]
    num_nodes = torch.tensor(counts, dtype=torch.int64, device=device)
    if chains:  # padding keeps the chain shape, so the verifier's chain test holds for the whole row
        parents = (torch.arange(width, device=device) - 1).expand(len(ids), width)
    else:
        parents = pad_sequence([t.parents for t in trees], batch_first=True, padding_value=-1).to(device)
    local = torch.arange(width + 1, device=device)[None, :]
    valid_rows = local <= num_nodes[:, None]
    start = torch.tensor([root_rows[i] for i in ids], dtype=torch.int64, device=device)
    rows = start[:, None] + torch.minimum(local, num_nodes[:, None])
    return _Packed(ids, counts, tokens, parents, num_nodes, rows, valid_rows, chains)


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
    target_argmax = logits_argmax[packed.rows]  # [B, N+1]
    if packed.chains:
        valid = packed.valid_rows[:, 1:] if packed.padded else None
        num_accepted, bonus = greedy_chain_counts(packed.tokens, target_argmax, valid)
        found = torch.stack([num_accepted, bonus]).tolist()
        out = []
        for i, count, last in zip(packed.ids, *found):
            out.append((drafts[i].tree.tokens[:count].tolist() + [last], count, list(range(count))))
        return out, None  # a chain's accepted nodes already sit at their depth: nothing to compact
    ancestors = _stacked_ancestors([drafts[i].tree for i in packed.ids], packed.tokens.shape[1])
    tokens, num_accepted, nodes = greedy_accept(packed.tokens, packed.parents, target_argmax, packed.num_nodes,
                                                False, ancestors.to(packed.tokens.device))
    return _rows(tokens, num_accepted, nodes), nodes


def _rows(tokens: Tensor, num_accepted: Tensor, nodes: Tensor) -> list:
    return [(row[: count + 1], count, path[:count])
            for row, count, path in zip(tokens.tolist(), num_accepted.tolist(), nodes.tolist())]


def _sampled(logits: Tensor, packed: _Packed, drafts: dict[int, SpecDraft], seqs: Sequence, generators: list):
    dev, vocab = logits.device, logits.shape[1]
    per_row = packed.num_nodes + 1  # verified rows per sequence
    params = [seqs[i].params for i in packed.ids]

    def repeat(values, dtype):
        return torch.tensor(values, dtype=dtype, device=dev).repeat_interleave(per_row)

    flat_rows = packed.rows[packed.valid_rows]
    probs = logits_to_probs(logits.index_select(0, flat_rows), repeat([p.temperature for p in params], torch.float32),
                            repeat([p.top_k for p in params], torch.int64),
                            repeat([p.top_p for p in params], torch.float32))
    batch, width = packed.tokens.shape
    target = probs.new_zeros(batch, width + 1, vocab)
    target[packed.valid_rows] = probs
    draft_probs, point_mass = None, None
    trees = [drafts[i].tree for i in packed.ids]
    if any(t.draft_probs is not None for t in trees):
        draft_probs = torch.zeros(batch, width, vocab, device=dev)
        point_mass = torch.ones(batch, width, dtype=torch.bool, device=dev)
        for b, (i, tree) in enumerate(zip(packed.ids, trees)):
            if tree.draft_probs is None:
                continue
            if tree.draft_probs.shape[-1] != vocab:
                raise ValueError(f"draft_probs vocab {tree.draft_probs.shape[-1]} != target vocab {vocab} "
                                 f"(request {seqs[i].request_id!r})")
            n = tree.num_nodes
            draft_probs[b, :n] = tree.draft_probs.to(dev, torch.float32)
            point_mass[b, :n] = False if tree.point_mass is None else tree.point_mass.to(dev)
    gens = [generators[i] for i in packed.ids]
    out = verify_batch(packed.tokens, packed.parents, target, False, gens, draft_probs, point_mass, packed.num_nodes)
    return _rows(out.tokens, out.num_accepted, out.accepted_nodes), None if packed.chains else out.accepted_nodes


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
    logits_argmax = logits.argmax(dim=-1) if greedy_ids else None  # [R]: one pass, no row copies
    for ids in (greedy_ids, sampled_ids):
        if not ids:
            continue
        packed = _pack(ids, drafts, root_rows, logits.device)
        if ids is greedy_ids:
            rows, nodes = _greedy(logits_argmax, packed, drafts)
        else:
            rows, nodes = _sampled(logits, packed, drafts, seqs, generators)
        results.update((i, VerifyResult(*row)) for i, row in zip(ids, rows))
        if nodes is not None:
            accepted.append((torch.tensor(ids, dtype=torch.int64), nodes))
    return RoundOutcome(results, accepted)
