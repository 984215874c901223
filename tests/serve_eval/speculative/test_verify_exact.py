"""Exactness of speculative verification: statistical tests against enumeration, plus greedy checks.

Toy world: vocabulary V = 8, a random "bigram LM" as the target (logit table T[prev, next]) and a
different one as the draft (D = T + noise, so acceptance is partial). Both go through the same
`logits_to_probs` with the config's temperature / top-k / top-p. We generate the first two tokens
after a fixed start token with speculation (a second speculative round runs when the first emits
only one token) and compare the empirical joint of (x1, x2) with the exact target joint
P(x1 | s0) P(x2 | x1), computed by enumeration.

Test: Pearson chi-square over the V*V cells (cells of expected count < 5 pooled into one bin, cells
of zero target probability must receive zero samples) at significance ALPHA = 0.001, with
N = 80,000 samples per configuration. Power: for any alternative at total-variation distance
delta from the target, the Pearson noncentrality is >= N * 4 * delta^2 (Cauchy-Schwarz on the
positive and negative parts of the perturbation, each of mass delta). Pooling can hide at most the
pooled mass, so we use delta_eff = 0.02 - pooled_mass and the asymptotic noncentral chi-square:
power = P(ncx2(df, N * 4 * delta_eff^2) > chi2.ppf(1 - ALPHA, df)) (tests/stats_helpers.py), computed in
each test and asserted >= 0.99 (with df <= 63 it is >= 0.9999). Negative controls (a verifier that always accepts,
and one that resamples from the target instead of the residual on rejection) are rejected by the same
test, and so is a verifier whose output is off by TV ~0.02 (target mixed 2.7% with uniform), which
shows the power is real.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from draftsmith.kernels.sampling import logits_to_probs, sample
from draftsmith.serve_eval.speculative.tree import DraftTree, TreeShape
from draftsmith.serve_eval.speculative.verify import (
    BatchVerifyOutput,
    verify_batch,
    verify_chain,
    verify_chains,
    verify_tree,
    verify_trees,
)
from stats_helpers import chi_square_fit

VOCAB = 8
START = 0
NUM_SAMPLES = 80_000
ALPHA = 1e-3
TV_TOLERANCE = 0.02


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """The simulations use small tensors; intra-op threads only add contention on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def bigram_tables(temperature: float, top_k: int, top_p: float, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """Target P[prev, next] and draft Q[prev, next] after the shared logits -> probs transform."""
    gen = torch.Generator().manual_seed(seed)
    target_logits = 1.5 * torch.randn(VOCAB, VOCAB, generator=gen)
    draft_logits = target_logits + 1.2 * torch.randn(VOCAB, VOCAB, generator=gen)
    rows = lambda logits: logits_to_probs(logits, temperature, top_k, top_p)  # noqa: E731
    return rows(target_logits), rows(draft_logits)


def build_round(prev, shape: TreeShape, kind: str, target, draft, gen):
    """Draft one tree per row below token prev [n]; kind: sampled | topk (point masses) | mixed."""
    n = prev.shape[0]
    tokens = torch.zeros((n, shape.num_nodes), dtype=torch.int64)
    draft_probs = torch.zeros((n, shape.num_nodes, VOCAB))
    point_mass = torch.zeros((n, shape.num_nodes), dtype=torch.bool)
    for node, (parent, rank) in enumerate(zip(shape.parents, shape.ranks)):
        context = prev if parent == -1 else tokens[:, parent]
        q = draft[context]
        if kind == "sampled" or (kind == "mixed" and rank > 0):
            tokens[:, node] = sample(q, gen)
            draft_probs[:, node] = q
        else:  # deterministic rank-th most likely draft token
            tokens[:, node] = q.sort(dim=-1, descending=True, stable=True).indices[:, rank]
            point_mass[:, node] = True
    rows = torch.cat([prev[:, None], tokens], dim=1)
    parents = torch.tensor(shape.parents).expand(n, -1)
    return tokens, parents, target[rows], draft_probs, point_mass


def exact_verifier(tokens, parents, target_probs, gen, draft_probs, point_mass) -> BatchVerifyOutput:
    return verify_batch(tokens, parents, target_probs, False, gen, draft_probs, point_mass)


def chain_verifier(tokens, parents, target_probs, gen, draft_probs, point_mass) -> BatchVerifyOutput:
    dense = None if bool(point_mass.all()) else draft_probs
    return verify_chains(tokens, target_probs, False, gen, dense)


def accept_always_verifier(tokens, parents, target_probs, gen, draft_probs, point_mass) -> BatchVerifyOutput:
    """Negative control (chains): emits every draft plus a bonus token."""
    n, k = tokens.shape
    bonus = sample(target_probs[:, -1], gen)
    out = torch.cat([tokens, bonus[:, None]], dim=1)
    return BatchVerifyOutput(out, torch.full((n,), k), torch.arange(k).expand(n, k))


def resample_target_verifier(tokens, parents, target_probs, gen, draft_probs, point_mass) -> BatchVerifyOutput:
    """Negative control (chains): correct acceptance test, but on rejection samples p, not norm(max(0, p - q))."""
    n, k = tokens.shape
    p_x = target_probs[:, :k].gather(2, tokens[:, :, None])[..., 0].double()
    q_x = draft_probs.gather(2, tokens[:, :, None])[..., 0].double()
    accepted = (torch.rand((n, k), dtype=torch.float64, generator=gen) * q_x < p_x).long().cumprod(dim=1)
    num_accepted = accepted.sum(dim=1)
    final = sample(target_probs[torch.arange(n), num_accepted], gen)  # the bug: target row, no residual
    out = torch.cat([tokens, torch.full((n, 1), -1)], dim=1)
    out[torch.arange(n), num_accepted] = final
    return BatchVerifyOutput(out, num_accepted, torch.arange(k).expand(n, k))


def run_round(prev, shape: TreeShape, kind: str, target, draft, verifier, gen) -> BatchVerifyOutput:
    tokens, parents, target_probs, draft_probs, point_mass = build_round(prev, shape, kind, target, draft, gen)
    return verifier(tokens, parents, target_probs, gen, draft_probs, point_mass)


def simulate(shape: TreeShape, kind: str, target, draft, verifier=exact_verifier, seed: int = 0):
    """First two generated tokens per sample; a second round speculates from x1 where the first emitted one."""
    gen = torch.Generator().manual_seed(seed)
    prev = torch.full((NUM_SAMPLES,), START, dtype=torch.int64)
    first = run_round(prev, shape, kind, target, draft, verifier, gen)
    x1, x2 = first.tokens[:, 0].clone(), first.tokens[:, 1].clone()
    short = (first.num_accepted == 0).nonzero()[:, 0]
    if short.numel():
        x2[short] = run_round(x1[short], shape, kind, target, draft, verifier, gen).tokens[:, 0]
    return x1, x2


def assert_matches_target(x1, x2, target, expect_match: bool = True) -> float:
    """Chi-square test of the (x1, x2) counts against the exact joint (tests/stats_helpers); returns the p-value."""
    joint = (target[START][:, None] * target).double().flatten()  # [V*V], exact by enumeration
    observed = torch.bincount(x1 * VOCAB + x2, minlength=VOCAB * VOCAB)
    fit = chi_square_fit(observed.numpy(), joint.numpy(), ALPHA, TV_TOLERANCE)
    assert fit.power >= 0.99, f"test too weak: power {fit.power:.4f} against TV {TV_TOLERANCE} (df {fit.df})"
    if expect_match:
        assert fit.p_value > ALPHA, f"speculative output differs from the target distribution: p = {fit.p_value:.2e}"
    return fit.p_value


CONFIGS = [
    # (name, tree shape, draft kind, verifier, temperature, top_k, top_p)
    ("chain K=2 sampled T=1", TreeShape.from_branching([1, 1]), "sampled", chain_verifier, 1.0, 0, 1.0),
    ("chain K=3 sampled T=0.7 top_p=0.9", TreeShape.from_branching([1, 1, 1]), "sampled", chain_verifier, 0.7, 0, 0.9),
    ("chain K=3 sampled T=1 top_k=5", TreeShape.from_branching([1, 1, 1]), "sampled", chain_verifier, 1.0, 5, 1.0),
    ("chain K=2 point-mass T=0.7", TreeShape.from_branching([1, 1]), "topk", chain_verifier, 0.7, 0, 1.0),
    ("tree 2x2 sampled siblings T=1", TreeShape.from_branching([2, 2]), "sampled", exact_verifier, 1.0, 0, 1.0),
    ("tree 3x1 top-k point masses T=0.7 top_p=0.9", TreeShape.from_branching([3, 1]), "topk", exact_verifier,
     0.7, 0, 0.9),
    ("tree 2x2 mixed siblings T=1 top_k=6", TreeShape.from_branching([2, 2]), "mixed", exact_verifier, 1.0, 6, 1.0),
    ("tree 3x2 sampled T=0.7 top_p=0.8", TreeShape.from_branching([3, 2]), "sampled", exact_verifier, 0.7, 0, 0.8),
    ("medusa-style paths mixed T=1", TreeShape.from_paths([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]), "mixed",
     exact_verifier, 1.0, 0, 1.0),
]


@pytest.mark.parametrize("name,shape,kind,verifier,temperature,top_k,top_p", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_speculative_sampling_matches_target(name, shape, kind, verifier, temperature, top_k, top_p):
    """The first two tokens under speculation follow the target's exact joint (chi-square, alpha=1e-3,
    N=80k, power >= 0.99 against any TV-0.02 error, computed and asserted in assert_matches_target)."""
    target, draft = bigram_tables(temperature, top_k, top_p)
    x1, x2 = simulate(shape, kind, target, draft)
    assert_matches_target(x1, x2, target)


def test_negative_control_accept_always_is_detected():
    """A verifier that accepts every draft emits the draft's distribution; the same test rejects it."""
    target, draft = bigram_tables(1.0, 0, 1.0)
    x1, x2 = simulate(TreeShape.from_branching([1, 1]), "sampled", target, draft, accept_always_verifier)
    assert assert_matches_target(x1, x2, target, expect_match=False) < ALPHA


def test_negative_control_resampling_target_on_rejection_is_detected():
    """Sampling the correction token from p instead of norm(max(0, p - q)) biases the output; detected."""
    target, draft = bigram_tables(1.0, 0, 1.0)
    x1, x2 = simulate(TreeShape.from_branching([1, 1]), "sampled", target, draft, resample_target_verifier)
    assert assert_matches_target(x1, x2, target, expect_match=False) < ALPHA


def test_negative_control_target_off_by_tv_002_is_detected():
    """A verifier whose target is off by ~0.02 TV in the joint (mixed 2.7% with uniform) is rejected:
    the power claim holds at the tolerance itself, not only for gross bugs."""
    target, draft = bigram_tables(1.0, 0, 1.0)
    eps = 0.027
    wrong = (1 - eps) * target + eps / VOCAB
    joint = (target[START][:, None] * target).flatten()
    wrong_joint = (wrong[START][:, None] * wrong).flatten()
    assert 0.02 <= 0.5 * float((joint - wrong_joint).abs().sum()) <= 0.025

    def off_target_verifier(tokens, parents, target_probs, gen, draft_probs, point_mass):
        return verify_chains(tokens, (1 - eps) * target_probs + eps / VOCAB, False, gen, draft_probs)

    x1, x2 = simulate(TreeShape.from_branching([1, 1]), "sampled", target, draft, off_target_verifier)
    assert assert_matches_target(x1, x2, target, expect_match=False) < ALPHA


# --------------------------------------------------------------------------------------------- greedy


def test_greedy_chain_accepts_prefix_then_emits_target_argmax():
    """Greedy: accept while draft == target argmax, then emit the target's argmax (bonus when all accepted)."""
    target = torch.zeros(4, 6)
    target[0, 2] = target[1, 3] = target[2, 5] = target[3, 1] = 1.0
    assert verify_chain([2, 3, 4], None, target, greedy=True) == ([2, 3, 5], 2, [0, 1])
    assert verify_chain([2, 3, 5], None, target, greedy=True) == ([2, 3, 5, 1], 3, [0, 1, 2])
    assert verify_chain([0, 3, 5], None, target, greedy=True) == ([2], 0, [])
    assert verify_chain([], None, target[:1], greedy=True) == ([2], 0, [])


def test_greedy_tree_follows_matching_child():
    """Greedy tree: at each node the child whose token is the target argmax is followed."""
    tree = DraftTree(torch.tensor([4, 2, 7, 3, 1]), torch.tensor([-1, -1, 1, 1, 3]))
    target = torch.zeros(6, 8)
    for row, best in enumerate([2, 0, 3, 0, 1, 6]):  # root -> node1 (2) -> node3 (3) -> node4 (1) -> bonus 6
        target[row, best] = 1.0
    assert verify_tree(tree, target, greedy=True) == ([2, 3, 1, 6], 3, [1, 3, 4])


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([[1, 1, 1], [2, 2], [3, 1], [1, 2, 2]]))
def test_sampling_on_one_hot_targets_equals_greedy(seed, branching):
    """With temperature-0 (one-hot) targets, rejection sampling is deterministic and equals greedy verify."""
    gen = torch.Generator().manual_seed(seed)
    shape = TreeShape.from_branching(branching)
    n = 16
    table = logits_to_probs(torch.randn(VOCAB, VOCAB, generator=gen), 0.0)
    draft = logits_to_probs(torch.randn(VOCAB, VOCAB, generator=gen), 1.0)
    prev = torch.randint(0, VOCAB, (n,), generator=gen)
    tokens, parents, target_probs, draft_probs, point_mass = build_round(prev, shape, "mixed", table, draft, gen)
    greedy = verify_batch(tokens, parents, target_probs, True, None, draft_probs, point_mass)
    sampled = verify_batch(tokens, parents, target_probs, False, gen, draft_probs, point_mass)
    assert torch.equal(greedy.tokens, sampled.tokens) and torch.equal(greedy.num_accepted, sampled.num_accepted)


# --------------------------------------------------------------------------------------- determinism


def test_seeded_request_is_batch_invariant():
    """A request's verification with its own generator gives the same result alone or inside a batch."""
    torch.manual_seed(3)
    shape = TreeShape.from_branching([2, 2])
    trees, targets = [], []
    for _ in range(5):
        dense = torch.softmax(torch.randn(shape.num_nodes, VOCAB), -1)
        trees.append(shape.fill(torch.randint(0, VOCAB, (shape.num_nodes,)), dense))
        targets.append(torch.softmax(torch.randn(shape.num_nodes + 1, VOCAB), -1))
    trees.append(DraftTree.chain([1, 2]))  # a differently shaped neighbour
    targets.append(torch.softmax(torch.randn(3, VOCAB), -1))
    for seed in range(20):
        gens = [torch.Generator().manual_seed(seed * 100 + b) for b in range(len(trees))]
        batch = verify_trees(trees, targets, [False] * len(trees), gens)
        for b in (0, 3, 5):
            alone = verify_tree(trees[b], targets[b], False, torch.Generator().manual_seed(seed * 100 + b))
            assert alone == batch[b]


# ---------------------------------------------------------------------------------------- bad input


def test_shape_mismatches_name_both_values():
    """Mismatched target/draft shapes raise ValueError naming both sides' values."""
    with pytest.raises(ValueError, match=r"target_probs shape \(4, 8\).*2 draft tokens"):
        verify_chain([1, 2], None, torch.rand(4, 8), False)
    with pytest.raises(ValueError, match=r"draft_probs shape \(2, 6\).*target_probs shape \(3, 8\)"):
        verify_chain([1, 2], torch.rand(2, 6), torch.rand(3, 8), False)
    with pytest.raises(ValueError, match=r"target_probs shape \(1, 3, 8\).*4 nodes"):
        verify_batch(torch.zeros(1, 4, dtype=torch.int64), torch.tensor([[-1, 0, 1, 2]]), torch.rand(1, 3, 8), False)
    tree = DraftTree.chain([1, 2, 3])
    with pytest.raises(ValueError, match=r"target_probs shape \(3, 8\).*3 nodes"):
        verify_tree(tree, torch.rand(3, 8), False)
