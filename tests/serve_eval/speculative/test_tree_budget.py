"""draftsmith.serve_eval.speculative.tree_budget: the tree shape chooser on scripted costs and acceptances, the online
calibration, the verify cost curve, and the budgeted dynamic builder (in the engine: probed and fed)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from draftsmith.serve_eval.engine import EngineConfig, LLMEngine, SamplingParams
from draftsmith.serve_eval.speculative.config import SpecConfig
from draftsmith.serve_eval.speculative.tree import DraftTree
from draftsmith.serve_eval.speculative.tree_budget import (AcceptanceCalibration, TreeBudget, TreeBudgetConfig, VerifyCostCurve,
                                                best_node_count, probe_token_counts)
from draftsmith.serve_eval.speculative.tree_dynamic import DynamicTreeBuilder
from spec_helpers import feature_draft, greedy_reference, make_llama, proposer_available, run_engine, workload


def test_best_node_count_on_scripted_costs():
    """(1 + 0.9 + 0.8 + 0.3) / (10 + 0.2 * 3) beats every other count; free nodes keep all, dear ones one."""
    values = torch.tensor([0.9, 0.8, 0.3, 0.05, 0.01])
    assert best_node_count(values, fixed_s=10.0, node_s=0.2) == 3
    assert best_node_count(values, fixed_s=10.0, node_s=0.0) == 5
    assert best_node_count(values, fixed_s=1.0, node_s=100.0) == 1
    assert best_node_count(torch.zeros(0), 1.0, 1.0) == 0


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=24), st.floats(1e-3, 10.0), st.floats(0.0, 2.0))
def test_best_node_count_is_the_brute_force_argmax(values, fixed_s, node_s):
    """Against direct evaluation of expected tokens per second at every count."""
    desc = torch.tensor(sorted(values, reverse=True), dtype=torch.float64)
    n = best_node_count(desc, fixed_s, node_s)
    rates = [(1 + float(desc[:m].sum())) / (fixed_s + node_s * m) for m in range(1, len(values) + 1)]
    assert rates[n - 1] >= max(rates) - 1e-12


def test_calibration_counts_reached_nodes_only():
    """Root children and children of accepted nodes are trials; the accepted path's nodes are the successes."""
    cal = AcceptanceCalibration(prior_accept=0.5, prior_strength=2.0)
    cells = torch.tensor([0, 1, 2, 3, 4])
    parents = torch.tensor([-1, -1, 0, 0, 1])  # node 4 hangs below the rejected node 1: no trial
    cal.observe(cells, parents, [0, 3])
    assert cal.trials[:5].tolist() == [3, 3, 3, 3, 2] and cal.accepted[:5].tolist() == [2, 1, 1, 2, 1]
    assert cal.rounds == 1


def test_calibration_converges_to_the_acceptance_rate():
    """Scripted Bernoulli acceptance per cell: the posterior means land on the true rates."""
    gen = torch.Generator().manual_seed(0)
    cal = AcceptanceCalibration()
    true_rate = {0: 0.95, 1: 0.2}
    cells = torch.tensor([0, 1])
    for _ in range(2000):
        first = bool(torch.rand(1, generator=gen) < true_rate[0])  # two siblings: at most one accepted
        second = not first and bool(torch.rand(1, generator=gen) < true_rate[1])
        cal.observe(cells, torch.tensor([-1, -1]), [0] if first else [1] if second else [])
    est = cal.conditional(cells)
    assert abs(float(est[0]) - 0.95) < 0.02   # ~5 standard errors
    assert abs(float(est[1]) - 0.2 * 0.05) < 0.02  # cell 1 is accepted only when cell 0 is not


def test_cells_separate_depth_rank_and_confidence():
    cal = AcceptanceCalibration()
    cells = cal.cells(torch.tensor([1, 2, 9, 1, 1]), torch.tensor([0, 0, 0, 5, 0]),
                      torch.tensor([0.1, 0.1, 0.1, 0.1, 0.9]))
    assert len(set(cells.tolist())) == 5
    assert int(cal.cells(torch.tensor([3]), torch.tensor([0]), torch.tensor([0.1]))) == int(cells[2])  # 3 == 3+


def test_verify_cost_curve_slopes_and_probe():
    """Least-squares slope over the lengths up to twice the batch's tokens, never negative; probe takes the
    median of its timings."""
    curve = VerifyCostCurve((1, 9, 17, 33), (0.010, 0.012, 0.014, 0.026))  # 0.25 ms/token, then 0.75
    assert math.isclose(curve.marginal_s(1), 0.002 / 8) and math.isclose(curve.marginal_s(8), 0.002 / 8)
    assert curve.marginal_s(17) > 0.002 / 8 and math.isclose(curve.marginal_s(100), curve.marginal_s(17))
    assert VerifyCostCurve((1, 2), (0.02, 0.01)).marginal_s(1) == 0.0
    clock = iter([9.0, 1.0, 3.0, 2.0, 9.0, 5.0, 4.0, 6.0])  # warm-up, then three timings per count
    probed = VerifyCostCurve.probe(lambda n: next(clock), [1, 17], repeats=3)
    assert probed.tokens == (1, 17) and probed.seconds == (2.0, 5.0)
    with pytest.raises(ValueError, match="increasing"):
        VerifyCostCurve((5, 1), (0.1, 0.2))
    assert probe_token_counts(16, 2048) == [1, 9, 17, 34, 68, 136] and probe_token_counts(16, 20) == [1, 9, 17]


CONFIDENCES = (0.1, 0.03, 0.02, 0.01)  # what the scripted draft offers, in rank order


def _measured_budget(round_s=0.020, tokens=4.0, nodes=8.0, node_s=0.0005) -> TreeBudget:
    budget = TreeBudget(TreeBudgetConfig(), VerifyCostCurve((1, 101), (0.010, 0.010 + 100 * node_s)))
    budget.observe_step(1, round_s, int(tokens), 1 + int(nodes), int(nodes))
    return budget


def _calibrate(budget: TreeBudget, rank0: float, other: float, rounds: int = 400) -> None:
    """Scripted verified rounds: at every depth the rank-0 candidate (confidence 0.1) is accepted with
    probability rank0, each of ranks 1-3 (confidences 0.03, 0.02, 0.01) with `other`."""
    cal, gen = budget.calibration, torch.Generator().manual_seed(1)
    for depth in (1, 2, 3):
        cells = cal.cells(torch.full((4,), depth), torch.arange(4), torch.tensor(CONFIDENCES))
        for _ in range(rounds):
            u = float(torch.rand(1, generator=gen))
            rank = 0 if u < rank0 else 1 + int((u - rank0) / other) if u < rank0 + 3 * other else None
            cal.observe(cells, torch.full((4,), -1), [] if rank is None else [rank])


def _grow(builder: DynamicTreeBuilder, conf=CONFIDENCES) -> DynamicTreeBuilder:
    """Every expanded node offers the same four candidates (confidences `conf`, in rank order)."""
    k = builder.top_k
    probs = torch.tensor(conf[:k])
    frontier = builder.add_root_candidates(torch.arange(k), probs)
    while frontier:
        frontier = builder.add_children(frontier, torch.arange(k).repeat(len(frontier), 1),
                                        probs.repeat(len(frontier), 1))
    return builder


def test_calibrated_tree_keeps_the_deep_path_that_raw_confidence_drops():
    """The regression this module fixes: a draft whose rank-0 confidence (0.1) hides a 0.95 acceptance.
    Raw cumulative confidence fills 16 nodes breadth-first and keeps no depth-4 node; the calibrated,
    costed tree keeps the rank-0 chain to depth 4 and only the siblings that pay."""
    fixed = _grow(DynamicTreeBuilder(4, 4, 16)).build()
    assert fixed.num_nodes == 16 and fixed.max_depth < 4
    budget = _measured_budget()
    _calibrate(budget, rank0=0.95, other=0.02)
    tree = _grow(DynamicTreeBuilder(4, 4, 16, budget)).build()
    assert tree.max_depth == 4 and tree.num_nodes < 16
    chain_path = [i for i in range(tree.num_nodes) if tree.path_to(i) and int(tree.tokens[i]) == 0]
    assert len(chain_path) >= 4  # the all-rank-0 path is there
    assert tree.cells is not None and tree.cells.shape == (tree.num_nodes,)
    dear = _measured_budget(node_s=0.02)  # a node costs a tenth of the round: only the chain pays
    _calibrate(dear, rank0=0.95, other=0.02)
    assert _grow(DynamicTreeBuilder(4, 4, 16, dear)).build().is_chain


def test_expansion_threshold_prunes_the_frontier():
    """Branches whose value cannot pay for a node's verification are not drafted further."""
    budget = _measured_budget(node_s=0.004)
    _calibrate(budget, rank0=0.95, other=0.02)
    builder = _grow(DynamicTreeBuilder(4, 4, 16, budget))
    unpruned = _grow(DynamicTreeBuilder(4, 4, 64))
    assert budget.expand_threshold() > 0.0 and builder.num_candidates < unpruned.num_candidates


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 4), st.integers(1, 5), st.integers(1, 30), st.floats(0, 0.05))
def test_budgeted_tree_is_ancestor_closed_and_within_budget(seed, top_k, depth, max_nodes, node_s):
    """Whatever the calibration and costs, the tree is valid, within max_nodes and depth, and non-empty."""
    gen = torch.Generator().manual_seed(seed)
    budget = _measured_budget(node_s=node_s)
    cal = budget.calibration
    cal.trials += torch.randint(0, 50, cal.trials.shape, generator=gen)
    cal.accepted += (torch.rand(cal.trials.shape, generator=gen) * (cal.trials - cal.accepted)).floor()
    cal.rounds = 1
    builder = DynamicTreeBuilder(top_k, depth, max_nodes, budget)
    frontier = builder.add_root_candidates(torch.arange(top_k), torch.rand(top_k, generator=gen))
    while frontier:
        probs = torch.rand(len(frontier), top_k, generator=gen)
        frontier = builder.add_children(frontier, torch.randint(0, 50, (len(frontier), top_k), generator=gen), probs)
    built = builder.build()
    DraftTree(built.tokens, built.parents, built.depths)  # full validation: topological, depths agree
    assert 1 <= built.num_nodes <= max_nodes and built.max_depth <= depth


def test_bad_budget_config_names_the_field():
    with pytest.raises(ValueError, match="prior_accept"):
        TreeBudgetConfig(prior_accept=1.0)
    with pytest.raises(ValueError, match="tree_budget must be one of"):
        SpecConfig("eagle", draft_path="x", tree="dynamic", tree_budget="cheap")


@pytest.mark.skipif(not proposer_available("eagle"), reason="EAGLE proposer not installed")
def test_engine_probes_costs_and_calibrates_while_staying_exact(tmp_path):
    """In the engine: the verify curve is probed at attach, every verified tree feeds the calibration, trees
    stay within the node budget, both shapes are measured (the budget drafts chains where they cost less), and
    greedy output equals plain decoding whichever shape each round took."""
    target = make_llama(tmp_path / "target", layers=2, seed=0)
    draft = feature_draft("eagle", target, tmp_path / "eagle")
    engine_opts = dict(block_size=4, max_model_len=96, num_gpu_blocks=200)
    prompts, lengths = workload(3, 5, max_len=12, max_out=16)
    expected = greedy_reference(target, prompts, lengths, **engine_opts)
    spec = SpecConfig("eagle", draft_path=str(draft), num_speculative_tokens=3, tree="dynamic", tree_top_k=2,
                      max_draft_nodes=6)
    engine = LLMEngine(EngineConfig(str(target), **engine_opts), speculative=spec)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    got = {rid: out.output_token_ids for rid, out in run_engine(engine, prompts, params).items()}
    assert got == expected
    budget = engine.strategy.proposer.tree_budget
    assert budget is not None and budget.curve is not None and budget.curve.tokens[:3] == (1, 4, 7)
    assert 0 < budget.calibration.rounds < engine.strategy.metrics.total.num_rounds   # the rest were chains
    assert all(arm.samples for arm in budget.shape.arms.values())
    assert budget.measured


def drive_shapes(budget: TreeBudget, rounds: int, seconds_per_token: dict[str, float]) -> list[bool]:
    """`rounds` scripted rounds at these costs per shape; returns use_chain() of each."""
    chains = []
    for _ in range(rounds):
        chain = budget.use_chain()
        chains.append(chain)
        budget.observe_step(1, seconds_per_token["chain" if chain else "tree"] * 3, 3, 1 + (4 if chain else 16),
                            4 if chain else 16, trees=not chain)
    return chains


def test_the_budget_drafts_the_shape_that_costs_less_per_token_and_re_tries_the_other():
    """Trees dearer per token than chains (as on a CPU, where their drafting and verify rows are not free): after
    both shapes' first rounds the budget drafts chains, re-trying a tree at a backed-off rate; with the costs
    swapped it keeps trees. The tree's round averages learn from tree rounds only."""
    budget = TreeBudget()
    chains = drive_shapes(budget, 400, {"tree": 4.0e-3, "chain": 2.0e-3})
    assert chains[:3] == [False] * 3 and chains[3:6] == [True] * 3
    later = chains[6:]
    assert sum(later) > 0.97 * len(later) and not all(later)   # trees re-tried, rarely
    assert budget.averages.round_s == pytest.approx(4.0e-3 * 3)
    keep = TreeBudget()
    assert sum(drive_shapes(keep, 400, {"tree": 2.0e-3, "chain": 3.0e-3})[6:]) < 0.1 * 394


def test_shapes_are_compared_by_their_rates_not_their_median_rounds():
    """Chain rounds of one cost that accept nothing or everything (1, 1, 5 tokens: 7/3 a round) against tree rounds
    of a steadier 2.8 tokens at a higher cost: the chain emits a token for 7.1 / (7/3) = 3.04 ms, the tree for
    9 / 2.8 = 3.21, so the chain wins (the median of the chain rounds' own ratios, 7.1 ms a token, had picked the
    tree)."""
    shapes = TreeBudget().shape
    for tokens in (1, 1, 5) * 3:
        shapes.observe("chain", 7.1e-3, tokens)
        shapes.observe("tree", 9.0e-3, 2.8)
    assert shapes.arms["chain"].median() > shapes.arms["tree"].median()
    assert shapes.winner() == "chain"


def test_a_shapes_rate_is_per_sequence_when_its_window_spans_batch_sizes():
    """Chain steps of 4 sequences (their share of the step's seconds and tokens) between steps of 1: the shape's
    rate is the per-sequence one, 7.1 ms over 7/3 tokens, whichever batch sizes its window holds."""
    budget = TreeBudget()
    for tokens in (1, 1, 5) * 3:
        budget.observe_step(4, 4 * 7.1e-3, 4 * tokens, 4 * 5, 4 * 4, trees=False)
        budget.observe_step(1, 7.1e-3, tokens, 5, 4, trees=False)
    assert budget.shape.arms["chain"].rate() == pytest.approx(7.1e-3 / (7 / 3))


def test_a_shape_that_becomes_cheaper_is_found_again():
    """Chains win first; then trees get cheap (e.g. a batch that makes verify rows free): the re-tries find it."""
    budget = TreeBudget()
    drive_shapes(budget, 200, {"tree": 4.0e-3, "chain": 2.0e-3})
    chains = drive_shapes(budget, 2000, {"tree": 1.0e-3, "chain": 2.0e-3})
    assert sum(chains[-200:]) < 0.1 * 200
