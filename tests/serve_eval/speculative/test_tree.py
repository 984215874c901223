"""draftsmith.serve_eval.speculative.tree: draft tree structure, static shapes, dynamic (EAGLE-2-style) construction."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from draftsmith.serve_eval.speculative.tree import DraftTree, TreeShape, check_node_budget
from draftsmith.serve_eval.speculative.tree_dynamic import DynamicTreeBuilder


def test_from_paths_orders_by_depth_and_links_parents():
    """Medusa-style choice paths become topologically ordered nodes with the right parents and ranks."""
    shape = TreeShape.from_paths([(0, 1), (1,), (0,), (0, 0), (0, 0, 0)])
    assert shape.paths == ((0,), (1,), (0, 0), (0, 1), (0, 0, 0))
    assert shape.parents == (-1, -1, 0, 0, 2)
    assert shape.ranks == (0, 1, 0, 1, 0)
    assert shape.max_depth == 3 and shape.max_rank == 2


def test_from_branching_builds_full_tree():
    """Branching [3, 2] gives 3 + 6 nodes, each depth-1 node with 2 children."""
    shape = TreeShape.from_branching([3, 2])
    assert shape.num_nodes == 9
    assert [shape.parents.count(p) for p in (-1, 0, 1, 2)] == [3, 2, 2, 2]


def test_shape_errors_name_both_values():
    """A missing parent path, a bad branching, or a shape over the node budget raise clear ValueErrors."""
    with pytest.raises(ValueError, match=r"\(0, 1\).*parent path \(0,\)"):
        TreeShape.from_paths([(1,), (0, 1)])
    with pytest.raises(ValueError, match="has 14 nodes but the node budget .* is 10"):
        TreeShape.from_branching([2, 2, 2], max_nodes=10)
    with pytest.raises(ValueError, match="has 3 nodes but the node budget .* is 2"):
        TreeShape.from_paths([(0,), (1,), (0, 0)], max_nodes=2)
    with pytest.raises(ValueError, match="branching"):
        TreeShape.from_branching([2, 0])
    with pytest.raises(ValueError, match="has 65 nodes .* is 64"):
        check_node_budget(65, 64)


def test_draft_tree_validation():
    """Non-topological parents, wrong depths, or draft_probs rows != nodes are rejected naming the values."""
    with pytest.raises(ValueError, match="parents"):
        DraftTree(torch.tensor([1, 2]), torch.tensor([1, -1]))
    with pytest.raises(ValueError, match="depths"):
        DraftTree(torch.tensor([1, 2]), torch.tensor([-1, 0]), depths=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match=r"draft_probs shape \(3, 5\).*2 nodes"):
        DraftTree(torch.tensor([1, 2]), torch.tensor([-1, 0]), draft_probs=torch.rand(3, 5))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=20))
def test_mask_positions_paths_agree_with_parents(seeds):
    """For random trees: mask[r, c] iff c is on r's root path; positions = root + depth; paths end at the node."""
    parents = [-1] + [s % (i + 1) - 1 for i, s in enumerate(seeds[1:], start=1)]  # parent in [-1, i-1]
    tree = DraftTree(torch.arange(len(parents)), torch.tensor(parents))
    mask = tree.attention_mask()
    positions = tree.positions(100)
    assert positions[0] == 100
    for node in range(tree.num_nodes):
        path = tree.path_to(node)
        assert path[-1] == node and len(path) == int(tree.depths[node]) == int(positions[node + 1]) - 100
        on_path = {0} | {p + 1 for p in path}
        assert {c for c in range(tree.num_nodes + 1) if mask[node + 1, c]} == on_path
    leaves = tree.retrieve_indices()
    for row, leaf in zip(leaves.tolist(), tree.leaves()):
        assert [n for n in row if n >= 0] == tree.path_to(leaf)


def test_fill_medusa_takes_head_candidates_by_depth_and_rank():
    """Node (c1, ..., cd) gets head d's c_d-th candidate, as a point mass."""
    shape = TreeShape.from_paths([(0,), (1,), (0, 0), (0, 1)])
    tree = shape.fill_medusa(torch.tensor([[10, 11], [20, 21], [30, 31]]))
    assert tree.tokens.tolist() == [10, 11, 20, 21]
    assert tree.parents.tolist() == [-1, -1, 0, 0] and tree.node_draft_probs(0) is None
    with pytest.raises(ValueError, match="too small"):
        shape.fill_medusa(torch.tensor([[10], [20]]))


def test_from_rows_marks_point_masses():
    """None rows become point masses; given rows keep their distribution."""
    q = torch.tensor([0.5, 0.5, 0.0])
    tree = DraftTree.from_rows([1, 0], [-1, -1], [None, q], vocab_size=3)
    assert tree.node_draft_probs(0) is None and torch.equal(tree.node_draft_probs(1), q)


def test_dynamic_tree_expands_best_frontier_and_keeps_best_nodes():
    """EAGLE-2: expand the top-k frontier by cumulative confidence, keep the max_nodes most confident."""
    builder = DynamicTreeBuilder(top_k=2, depth=3, max_nodes=5)
    frontier = builder.add_root_candidates(torch.tensor([7, 8, 9]), torch.tensor([0.6, 0.3, 0.1]))
    assert frontier == [0, 1]  # tokens 7 and 8
    frontier = builder.add_children(frontier, torch.tensor([[1, 2], [3, 4]]), torch.tensor([[0.9, 0.05], [0.5, 0.4]]))
    # scores: 7->1 .54, 7->2 .03, 8->3 .15, 8->4 .12: expand nodes 3 (7->1) and 5 (8->3)
    assert frontier == [3, 5]
    assert builder.add_children(frontier, torch.tensor([[5], [6]]), torch.tensor([[0.9], [0.1]])) == []
    tree = builder.build()  # keep .6 (7), .54 (7->1), .486 (7->1->5), .3 (8), .15 (8->3)
    assert tree.tokens.tolist() == [7, 8, 1, 3, 5]
    assert tree.parents.tolist() == [-1, -1, 0, 1, 2]


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 4), st.integers(1, 5), st.integers(1, 30))
def test_dynamic_tree_is_ancestor_closed_and_within_budget(seed, top_k, depth, max_nodes):
    """Whatever the confidences, the built tree is valid (parents kept), <= max_nodes, <= depth."""
    gen = torch.Generator().manual_seed(seed)
    builder = DynamicTreeBuilder(top_k, depth, max_nodes)
    frontier = builder.add_root_candidates(torch.arange(top_k), torch.rand(top_k, generator=gen))
    while frontier:
        probs = torch.rand(len(frontier), top_k, generator=gen)
        frontier = builder.add_children(frontier, torch.randint(0, 50, (len(frontier), top_k), generator=gen), probs)
    tree = builder.build()  # DraftTree validates topological order and depths
    assert 1 <= tree.num_nodes <= max_nodes and tree.max_depth <= depth


def test_dynamic_tree_bad_input():
    """Non-positive sizes and mismatched candidate shapes raise ValueError naming the values."""
    with pytest.raises(ValueError, match="top_k must be > 0, got 0"):
        DynamicTreeBuilder(0, 3, 10)
    builder = DynamicTreeBuilder(2, 3, 10)
    with pytest.raises(ValueError, match=r"tokens shape \(1, 2\), probs shape \(1, 3\)"):
        builder.add_root_candidates(torch.tensor([1, 2]), torch.tensor([0.1, 0.2, 0.3]))
