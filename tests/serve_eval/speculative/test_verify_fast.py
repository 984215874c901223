"""The closed-form verifiers (spec.verify_fast) against the general one (verify_reference), token for token,
and DraftTree's vectorised geometry against a per-node walk up the parents."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from draftsmith.kernels.sampling import logits_to_probs
from draftsmith.serve_eval.speculative.tree import DraftTree, tree_ancestors, tree_depths
from draftsmith.serve_eval.speculative.tree_dynamic import DynamicTreeBuilder
from draftsmith.serve_eval.speculative.verify import verify_batch, verify_reference

VOCAB = 6  # small, so random drafts often hit the target's argmax and paths get deep


def random_parents(seeds: list[int]) -> list[int]:
    """A topologically ordered parent array: parents[i] in [-1, i - 1]."""
    return [s % (i + 1) - 1 for i, s in enumerate(seeds)]


def walk_ancestors(parents: list[int]) -> torch.Tensor:  # the obvious per-node walk, as the reference
    size = len(parents) + 1
    anc = torch.zeros(size, size, dtype=torch.bool)
    anc[0, 0] = True
    for node in range(len(parents)):
        row = node
        while row != -1:
            anc[node + 1, row + 1] = True
            row = parents[row]
        anc[node + 1, 0] = True
    return anc


def random_batch(gen: torch.Generator, parents: list[list[int]], num_nodes: list[int], temperature: float):
    batch, width = len(parents), len(parents[0])
    tokens = torch.randint(0, VOCAB, (batch, width), generator=gen)
    logits = 2 * torch.randn(batch * (width + 1), VOCAB, generator=gen)
    target = logits_to_probs(logits, temperature).reshape(batch, width + 1, VOCAB)
    draft = torch.softmax(torch.randn(batch, width, VOCAB, generator=gen), -1)
    return tokens, torch.tensor(parents), target, draft, torch.tensor(num_nodes)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(st.integers(0, 10**6), min_size=1, max_size=12), min_size=1, max_size=4),
       st.integers(0, 2**31 - 1), st.booleans())
def test_greedy_fast_path_equals_reference(trees, seed, chains):
    """T = 0: argmax-only verification gives the general verifier's tokens, counts and paths exactly,
    for chains and random trees with padding (duplicate sibling tokens included)."""
    gen = torch.Generator().manual_seed(seed)
    width = max(len(t) for t in trees)
    if chains:
        parents = [[i - 1 for i in range(width)] for _ in trees]
    else:
        parents = [random_parents(t) + [-1] * (width - len(t)) for t in trees]
    num_nodes = [len(t) for t in trees] if not chains else [width] * len(trees)
    tokens, parents_t, target, _, nodes = random_batch(gen, parents, num_nodes, 0.0)
    fast = verify_batch(tokens, parents_t, target, True, num_nodes=nodes)
    ref = verify_reference(tokens, parents_t, target, True, num_nodes=nodes)
    assert fast.to_results() == ref.to_results()
    assert torch.equal(fast.num_accepted, ref.num_accepted)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 6), st.integers(1, 5), st.integers(0, 2**31 - 1), st.sampled_from(["dense", "point", "mixed"]))
def test_sampled_chain_fast_path_equals_reference_draw_for_draw(k, batch, seed, kind):
    """T > 0 chains: with per-row generators the closed form consumes the same draws as the general
    verifier and emits the same tokens (padding rows included)."""
    gen = torch.Generator().manual_seed(seed)
    parents = [[i - 1 for i in range(k)]] * batch
    num_nodes = torch.randint(1, k + 1, (batch,), generator=gen).tolist()
    tokens, parents_t, target, draft, nodes = random_batch(gen, parents, num_nodes, 0.8)
    draft_probs = None if kind == "point" else draft
    point_mass = None if kind != "mixed" else torch.rand(batch, k, generator=gen) < 0.5
    outs = []
    for verifier in (verify_batch, verify_reference):
        gens = [torch.Generator().manual_seed(seed + b) for b in range(batch)]
        outs.append(verifier(tokens, parents_t, target, False, gens, draft_probs, point_mass, nodes).to_results())
    assert outs[0] == outs[1]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 10**6), min_size=1, max_size=24), min_size=1, max_size=3))
def test_ancestors_and_depths_of_random_parent_arrays(trees):
    """Pointer-doubling ancestors / depths equal a per-node walk, batched over padded parent arrays."""
    width = max(len(t) for t in trees)
    parents = [random_parents(t) + [-1] * (width - len(t)) for t in trees]
    batched_anc = tree_ancestors(torch.tensor(parents))
    batched_depth = tree_depths(torch.tensor(parents))
    for b, p in enumerate(parents):
        walk = walk_ancestors(p)
        assert torch.equal(batched_anc[b], walk)
        assert batched_depth[b].tolist() == (walk[1:].sum(-1) - 1).tolist()  # ancestors-or-self minus the root


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=20), st.integers(0, 20))
def test_draft_tree_geometry_and_prefix(seeds, cut):
    """DraftTree owns depths, ancestors, positions and paths; a prefix slices them consistently."""
    parents = random_parents(seeds)
    tree = DraftTree(torch.arange(len(parents)), torch.tensor(parents))
    anc = walk_ancestors(parents)
    assert torch.equal(tree.ancestors(), anc) and torch.equal(tree.attention_mask(), anc)
    assert torch.equal(tree.positions(7), anc.sum(-1) - 1 + 7)
    for node in range(tree.num_nodes):
        assert tree.path_to(node) == [c - 1 for c in range(1, len(parents) + 1) if anc[node + 1, c]]
    n = min(cut, tree.num_nodes)
    head = tree.prefix(n)
    assert head.num_nodes == n and torch.equal(head.ancestors(), anc[: n + 1, : n + 1])
    assert torch.equal(head.depths, tree.depths[:n])
    fresh = DraftTree(tree.tokens[:n], tree.parents[:n])
    assert torch.equal(fresh.ancestors(), head.ancestors()) and torch.equal(fresh.depths, head.depths)


def test_chain_tree_geometry():
    """A chain's depths are 1..K, its mask is causal and it reports itself as a chain."""
    tree = DraftTree.chain([5, 6, 7])
    assert tree.depths.tolist() == [1, 2, 3] and tree.is_chain
    assert torch.equal(tree.ancestors(), torch.ones(4, 4, dtype=torch.bool).tril())
    assert not DraftTree(torch.tensor([1, 2]), torch.tensor([-1, -1])).is_chain


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 20), st.integers(0, 2**31 - 1))
def test_dynamic_builder_ancestors_match_a_fresh_tree(top_k, depth, max_nodes, seed):
    """The builder grows ancestor rows incrementally; its candidate tree and its built tree carry exactly
    the geometry a fresh DraftTree computes from their parents."""
    gen = torch.Generator().manual_seed(seed)
    builder = DynamicTreeBuilder(top_k, depth, max_nodes)
    frontier = builder.add_root_candidates(torch.randint(0, 50, (top_k,), generator=gen),
                                           torch.rand(top_k, generator=gen))
    while frontier:
        shape = (len(frontier), top_k)
        frontier = builder.add_children(frontier, torch.randint(0, 50, shape, generator=gen), torch.rand(shape, generator=gen))
    for tree in (builder.candidates(), builder.build()):
        fresh = DraftTree(tree.tokens, tree.parents)
        assert torch.equal(tree.ancestors(), fresh.ancestors()) and torch.equal(tree.depths, fresh.depths)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 10**6), min_size=1, max_size=8), st.booleans(), st.booleans()),
                min_size=1, max_size=4), st.integers(0, 2**31 - 1))
def test_round_verify_equals_general_path_on_logits(drafts_spec, seed):
    """The engine's round verification (argmax-only T = 0 drafts, probabilities only for sampled ones)
    emits what the general verifier emits on logits_to_probs of every row, token for token, for a batch
    mixing greedy and sampled sequences, chains and trees of different sizes."""
    from types import SimpleNamespace

    from draftsmith.serve_eval.speculative.round_verify import SpecDraft, verify_round

    gen = torch.Generator().manual_seed(seed)
    drafts, seqs, root_rows, row = {}, [], {}, 0
    for b, (seeds, is_tree, greedy) in enumerate(drafts_spec):
        tokens = torch.randint(0, VOCAB, (len(seeds),), generator=gen)
        tree = DraftTree(tokens, torch.tensor(random_parents(seeds))) if is_tree else DraftTree.chain(tokens)
        drafts[b] = SpecDraft(b, tree, is_tree)
        params = SimpleNamespace(temperature=0.0 if greedy else 0.9, top_k=0, top_p=1.0)
        seqs.append(SimpleNamespace(params=params, request_id=f"r{b}"))
        root_rows[b], row = row, row + len(seeds) + 1
    logits = 2 * torch.randn(row, VOCAB, generator=gen)
    fast = verify_round(logits, root_rows, drafts, seqs,
                        [torch.Generator().manual_seed(seed + b) for b in range(len(seqs))]).results
    for b, seq in enumerate(seqs):
        tree = drafts[b].tree
        rows = logits[root_rows[b]:root_rows[b] + tree.num_nodes + 1]
        probs = logits_to_probs(rows, seq.params.temperature)[None]
        ref = verify_reference(tree.tokens[None], tree.parents[None], probs, seq.params.temperature == 0,
                               [torch.Generator().manual_seed(seed + b)])
        assert fast[b] == ref.to_results()[0]
