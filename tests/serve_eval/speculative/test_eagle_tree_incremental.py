"""Incremental EAGLE-2 tree drafting (serve_eval.speculative.proposers.eagle_tree): each depth runs the draft on
its new frontier only, over the paged draft cache with a tree mask. It must build the same candidate tree - the
same candidates under the same parents, with the same draft confidences (fp32 tolerance) - as a full recompute
that reruns the whole context and every expanded node from scratch, densely, at every depth."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from draftsmith.serve_eval.speculative.proposers import eagle_tree
from draftsmith.serve_eval.speculative.proposers.tree_attention import TreeStepLayout
from draftsmith.serve_eval.speculative.tree_budget import TreeBudget, VerifyCostCurve
from draftsmith.serve_eval.speculative.tree_dynamic import DynamicTreeBuilder
from draftsmith.serve_eval.speculative.verify import VerifyResult
from spec_helpers import Seq, params
from test_eagle_proposer import PROPOSERS, TARGET, VOCAB, feature_table, feats, make_draft


@pytest.fixture(scope="module")
def target_dir(family_checkpoint):
    return family_checkpoint("llama", **TARGET)


class RecordingBuilder(DynamicTreeBuilder):
    """A DynamicTreeBuilder that keeps every expansion it was given: (parent ids, tokens, confidences)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.expansions: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []

    def add_children(self, parent_ids, tokens, probs):
        self.expansions.append((list(parent_ids), tokens.clone(), probs.clone()))
        return super().add_children(parent_ids, tokens, probs)


def dense_attn(mask: torch.Tensor):
    """Attention over exactly this forward's tokens with a given bool mask [T, T] (no cache at all)."""

    def attn(q, k, v):
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None], attn_mask=mask,
                                             enable_gqa=k.shape[1] != q.shape[1])
        return out[0].transpose(0, 1)

    return attn


def full_recompute_tree(draft, kind, tokens, hidden, aux, top_k, depth, max_nodes, budget):
    """Every depth reruns the committed (feature, token) pairs and all expanded nodes in one dense forward:
    committed entries causal, a node seeing every committed entry plus its ancestors and itself."""
    root = len(tokens) - 1
    logits_of = draft.compute_logits if kind == "eagle" else (lambda h: draft.to_target_logits(draft.compute_logits(h)))
    ids = torch.tensor(tokens[1:root + 1])
    x = hidden[:root] if kind == "eagle" else draft.fuse(aux[:root])
    pos = torch.arange(root)
    root_feat = draft(ids, x, pos, dense_attn(torch.ones(root, root, dtype=torch.bool).tril()))[-1:]
    builder = RecordingBuilder(top_k, depth, max_nodes, budget)
    outputs = {-1: root_feat[0]}
    top = torch.softmax(logits_of(root_feat).float(), -1).topk(top_k)
    frontier = builder.add_root_candidates(top.indices[0], top.values[0])
    expanded: list[int] = []
    while frontier:
        expanded += frontier
        cands = builder.candidates()
        nodes = torch.tensor(expanded)
        n = root + len(expanded)
        mask = torch.zeros(n, n, dtype=torch.bool)
        mask[:root, :root] = torch.ones(root, root, dtype=torch.bool).tril()
        mask[root:, :root] = True
        mask[root:, root:] = cands.ancestors()[nodes + 1][:, nodes + 1]
        node_x = torch.stack([outputs[int(p)] for p in cands.parents[nodes]])
        out = draft(torch.cat([ids, cands.tokens[nodes]]), torch.cat([x, node_x]),
                    torch.cat([pos, root + cands.depths[nodes] - 1]), dense_attn(mask))
        new = out[-len(frontier):]
        for j, node in enumerate(frontier):
            outputs[node] = new[j]
        top = torch.softmax(logits_of(new).float(), -1).topk(top_k)
        frontier = builder.add_children(frontier, top.indices, top.values)
    return builder


def measured_budget(rank1_bin: int) -> TreeBudget:
    """A cost model that has seen rounds: calibrated cells and measured costs, so frontiers get thinned by the
    expansion floor and the kept count is chosen, not fixed. rank1_bin: the first confidence bin in which a
    rank-1 candidate counts as accepted (where the floor cuts rank 1)."""
    budget = TreeBudget(curve=VerifyCostCurve((1, 9, 17), (4e-3, 8e-3, 12e-3)))
    cal = budget.calibration
    conf = torch.tensor([0.01, 0.03, 0.07, 0.15, 0.3, 0.7])
    for depth in (1, 2, 3):
        for rank in (0, 1, 2):
            cells = cal.cells(torch.full((6,), depth), torch.full((6,), rank), conf)
            # rank 0 always accepted (conditional 5/6, above the expansion floor), rank 1 from confidence bin
            # rank1_bin on, rank 2+ never (1/6, below the floor)
            accepted = list(range(6)) if rank == 0 else list(range(rank1_bin, 6)) if rank == 1 else []
            for _ in range(4):
                cal.observe(cells, torch.full((6,), -1), accepted)
    budget.observe_step(1, 6e-3, 3, 17, 16)
    return budget


def assert_same_expansions(got: RecordingBuilder, want: RecordingBuilder) -> None:
    assert len(got.expansions) == len(want.expansions)
    for (gp, gt, gc), (wp, wt, wc) in zip(got.expansions, want.expansions):
        assert gp == wp and torch.equal(gt, wt)
        torch.testing.assert_close(gc, wc, atol=1e-5, rtol=1e-4)
    built, ref = got.build(), want.build()
    assert torch.equal(built.tokens, ref.tokens) and torch.equal(built.parents, ref.parents)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("budgeted", [False, True])
@torch.inference_mode()
def test_incremental_tree_equals_full_recompute(kind, budgeted, target_dir, monkeypatch):
    """A batch of three sequences (different lengths, so their tree entries sit at different cache offsets
    across block boundaries): each builder gets exactly the reference's expansions, and the cache holds only
    committed entries again after verification."""
    built: list[RecordingBuilder] = []

    class Recorded(RecordingBuilder):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            built.append(self)

    monkeypatch.setattr(eagle_tree, "DynamicTreeBuilder", Recorded)
    draft = make_draft(kind, target_dir)
    top_k, depth, max_nodes = 3, 4, 10
    # The rank-1 cut sits between these seeded drafts' root confidences, so the sequences' frontiers differ.
    budget = measured_budget(4 if kind == "eagle" else 3) if budgeted else None
    proposer = PROPOSERS[kind].from_draft(draft, num_blocks=64, block_size=4, tree=(top_k, depth, max_nodes),
                                          tree_budget=budget)
    cases = []
    for i, length in enumerate([2, 7, 13]):
        hidden, aux = feature_table(kind, length, seed=40 + i)
        tokens = torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(50 + i)).tolist()
        proposer.add_features(f"s{i}", feats(hidden, aux, 0, length - 1))
        cases.append((Seq(f"s{i}", tokens, params()), hidden, aux))
    proposals = proposer.propose([c[0] for c in cases], [depth] * len(cases))
    assert len(built) == len(cases)
    for (seq, hidden, aux), proposal, got in zip(cases, proposals, built):
        want = full_recompute_tree(draft, kind, seq.token_ids, hidden, aux, top_k, depth, max_nodes, budget)
        assert_same_expansions(got, want)
        assert torch.equal(proposal.tokens, want.build().tokens)
    if budgeted:  # the floor gave sequences frontiers of different widths at some depth: padded queries ran
        widths = [[len(p) for p, _, _ in b.expansions[1:]] for b in built]
        assert any(len({w[d] for w in widths if d < len(w)}) > 1 for d in range(depth))
    for seq, _, _ in cases:
        proposer.on_accepted(seq.request_id, VerifyResult([1], 0, []))
        assert proposer.num_cached_entries(seq.request_id)[1] == len(seq.token_ids) - 1
    proposer.check_integrity()


def test_tree_step_layout_masks_committed_tree_and_padding():
    """Committed entries visible to every new node, tree entries by the given mask, padding never visible;
    the new nodes' slots are the last entries of each context (through the block table)."""
    tree_a = torch.tensor([[True, False, True], [True, True, False]])  # 2 new nodes over 3 tree entries
    tree_b = torch.tensor([[True]])
    layout = TreeStepLayout.build([[5, 2], [7]], 4, [3, 2], [tree_a, tree_b], "cpu")
    assert layout.key_slots.shape == (2, 6) and layout.mask.shape == (2, 2, 6)
    assert layout.key_slots[0].tolist() == [20, 21, 22, 23, 8, 9]
    assert layout.slot_mapping.tolist() == [8, 9, 30]  # a: entries 4, 5 of 6 (block 2); b: entry 2 (block 7)
    assert layout.mask[0, :, :3].all() and torch.equal(layout.mask[0, :, 3:], tree_a)
    assert layout.mask[1, 0].tolist() == [True, True, True, False, False, False]
    assert layout.mask[1, 1].tolist() == [True, False, False, False, False, False]  # padding row: key 0 only
    assert layout.query_index.tolist() == [0, 1, 2]
