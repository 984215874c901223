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
from serve_eval.spec.verify_fast import greedy_accept


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
    # Per verified group (greedy, sampled): batch indices [B] and accepted node ids [B, D], -1 padded.
    accepted: list[tuple[Tensor, Tensor]]


@dataclass
class _Packed:
    ids: list[int]  # batch indices, in row order
    tokens: Tensor  # int64 [B, N]
    parents: Tensor  # int64 [B, N]
    num_nodes: Tensor  # int64 [B]
    rows: Tensor  # int64 [B, N+1] logits row of [root, nodes...]; padding repeats the root row
    valid_rows: Tensor  # bool [B, N+1]
    chains: bool


def _pack(ids: list[int], drafts: dict[int, SpecDraft], root_rows: dict[int, int], device) -> _Packed:
    trees = [drafts[i].tree for i in ids]
    chains = not any(drafts[i].is_tree for i in ids)
    tokens = pad_sequence([t.tokens for t in trees], batch_first=True).to(device)
    width = tokens.shape[1]
    num_nodes = torch.tensor([t.num_nodes for t in trees], dtype=torch.int64, device=device)
    if chains:  # padding keeps the chain shape, so the verifier's chain test holds for the whole row
        parents = (torch.arange(width, device=device) - 1).expand(len(ids), width)
    else:
        parents = pad_sequence([t.parents for t in trees], batch_first=True, padding_value=-1).to(device)
    local = torch.arange(width + 1, device=device)
    valid_rows = local[None, :] <= num_nodes[:, None]
    start = torch.tensor([root_rows[i] for i in ids], dtype=torch.int64, device=device)
    rows = start[:, None] + torch.where(valid_rows, local, 0)
    return _Packed(ids, tokens, parents, num_nodes, rows, valid_rows, chains)


def _greedy(logits: Tensor, packed: _Packed):
    target_argmax = logits.index_select(0, packed.rows.flatten()).argmax(dim=-1).view_as(packed.rows)
    return greedy_accept(packed.tokens, packed.parents, target_argmax, packed.num_nodes, packed.chains)


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
    return out.tokens, out.num_accepted, out.accepted_nodes


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
    for ids, run in ((greedy_ids, _greedy), (sampled_ids, _sampled)):
        if not ids:
            continue
        packed = _pack(ids, drafts, root_rows, logits.device)
        args = (logits, packed) if run is _greedy else (logits, packed, drafts, seqs, generators)
        tokens, num_accepted, nodes = run(*args)
        for i, row, count, path in zip(ids, tokens.tolist(), num_accepted.tolist(), nodes.tolist()):
            results[i] = VerifyResult(row[: count + 1], count, path[:count])
        accepted.append((torch.tensor(ids, dtype=torch.int64), nodes))
    return RoundOutcome(results, accepted)
