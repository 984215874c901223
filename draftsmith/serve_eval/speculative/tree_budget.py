"""Trees that pay: which candidates a dynamic draft tree keeps, and how many, from measured acceptance and cost.

Value. A node's value is the probability that verification accepts it: the product, along its path, of
P(node accepted | parent accepted). The draft's own confidence ranks candidates but is not that probability
(the embedded EAGLE draft's rank-0 candidates carry a softmax of about 0.1 over 4096 tokens and are accepted
~99% of the time; its rank-1 candidates of 0.05 about 1%), so ranking by raw cumulative confidence (EAGLE-2's)
fills the budget with shallow siblings and drops the deep path. The conditional is therefore calibrated
online from the engine's own verified rounds, per cell = (depth bucket, sibling rank bucket, confidence bin),
a Beta posterior mean whose prior is optimistic so that an unseen cell is tried before it is judged.

Budget. A round emits 1 + sum(kept values) tokens in expectation and costs fixed_s (the draft, the forward's
base, the rest of the step) + node_s per kept node, node_s being the target's measured marginal seconds per
verified token at the current batch's token count (VerifyCostCurve: the target's forward timed at a few
query lengths, batch 1, once at start-up). The kept count n maximises (1 + V_n) / (fixed_s + node_s n) over
the value-sorted candidates; a value-sorted prefix is closed under ancestors because every conditional is < 1.
Expansion uses the same economics: a frontier node is drafted further only when its value reaches
node_s x tokens per second (the value at which one more node pays for its verification), so the draft
never spends forwards on branches that could not be kept.

Shape. That model prices verified nodes, not the tree's own drafting: each depth drafts its whole frontier
(top_k rows per expanded node) in a torch forward, where a chain's K steps run in one native loop. On the
2-core CPU (fp32, K=4, 16 nodes) a tree round cost 12.6 ms (draft 3.9, a 17-row verify 7.6) against a chain's
5.6 (1.3, 3.8), so the tree's tau 3.03 against 2.56 ran at 0.81x of plain decoding where the chain ran 1.44x.
So the budget also measures both shapes and drafts the one that costs less per emitted token: the median seconds
of each shape's latest rounds over their mean tokens (ArmCosts.rate: a round's cost is set by its shape, its tokens
by acceptance); the losing shape is re-tried one round at a time, every
`shape_retry_every` rounds of the winner, that interval doubling (to 16x) each time it loses again (the batch gate's
way of choosing arms, speculative.measured_arms). Where the
verify rows are nearly free (a GPU at small batch) the tree keeps winning; where they are not, the budget runs
chains, and its tree calibration keeps learning from the re-tries.
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from draftsmith.serve_eval.speculative.measured_arms import ArmCosts, RetryBackoff

CONFIDENCE_EDGES = (0.02, 0.05, 0.1, 0.2, 0.5)  # bin upper edges of the draft's confidence (roughly log-spaced)
DEPTH_BUCKETS = 3  # depths 1, 2, 3+
RANK_BUCKETS = 3  # sibling ranks 0, 1, 2+


@dataclass
class TreeBudgetConfig:
    prior_accept: float = 0.5  # prior mean of every cell's conditional acceptance (optimistic: cells get tried)
    prior_strength: float = 2.0  # prior pseudo-trials; a few verified rounds outweigh it
    ema: float = 0.1  # weight of a new step in the round-cost and tokens-per-round averages
    probe_repeats: int = 3  # timed forwards per probed query length (median kept)
    shape_window: int = 32  # a shape's cost: its latest rounds' mean tokens under the median seconds of the last 8
    shape_min_rounds: int = 3  # rounds of each shape before they are compared
    shape_retry_every: int = 16  # rounds of the winning shape between re-tries of the other (doubling, to 16x)

    def __post_init__(self) -> None:
        if not 0 < self.prior_accept < 1 or self.prior_strength <= 0:
            raise ValueError(f"tree budget: prior_accept must be in (0, 1) and prior_strength > 0, got "
                             f"{self.prior_accept}, {self.prior_strength}")
        if not 0 < self.ema <= 1 or self.probe_repeats < 1:
            raise ValueError(f"tree budget: ema in (0, 1] and probe_repeats >= 1, got {self.ema}, {self.probe_repeats}")
        if not 1 <= self.shape_min_rounds <= self.shape_window or self.shape_retry_every < 1:
            raise ValueError(f"tree budget: 1 <= shape_min_rounds <= shape_window and shape_retry_every >= 1, got "
                             f"{self.shape_min_rounds}, {self.shape_window}, {self.shape_retry_every}")


class AcceptanceCalibration:
    """P(node accepted | parent accepted) per cell, from verified rounds (Beta posterior means)."""

    def __init__(self, prior_accept: float = 0.5, prior_strength: float = 2.0) -> None:
        num_cells = DEPTH_BUCKETS * RANK_BUCKETS * (len(CONFIDENCE_EDGES) + 1)
        self.accepted = torch.full((num_cells,), prior_accept * prior_strength, dtype=torch.float64)
        self.trials = torch.full((num_cells,), prior_strength, dtype=torch.float64)
        self._edges = torch.tensor(CONFIDENCE_EDGES, dtype=torch.float64)
        self.rounds = 0  # verified trees observed

    def cells(self, depths: Tensor, ranks: Tensor, confidence: Tensor) -> Tensor:  # -> int64, same shape
        depth = depths.clamp(1, DEPTH_BUCKETS) - 1
        rank = ranks.clamp(0, RANK_BUCKETS - 1)
        conf = torch.bucketize(confidence.double(), self._edges, right=True)
        return (depth * RANK_BUCKETS + rank) * (len(CONFIDENCE_EDGES) + 1) + conf

    def conditional(self, cells: Tensor) -> Tensor:  # float64, same shape; always in (0, 1)
        return self.accepted[cells] / self.trials[cells]

    def observe(self, cells: Tensor, parents: Tensor, accepted_node_ids: Sequence[int]) -> None:
        """One verified tree: every node whose parent was reached (the root, or an accepted node) is a trial,
        a success when it is on the accepted path."""
        on_path = torch.zeros(parents.numel() + 1, dtype=torch.bool)
        on_path[0] = True
        if accepted_node_ids:
            on_path[torch.tensor(list(accepted_node_ids), dtype=torch.int64) + 1] = True
        self.rounds += 1
        reached = on_path[parents.cpu() + 1]
        cells = cells.cpu()
        self.trials.index_add_(0, cells[reached], torch.ones(int(reached.sum()), dtype=torch.float64))
        self.accepted.index_add_(0, cells[reached], on_path[1:][reached].double())


def best_node_count(values_desc: Tensor, fixed_s: float, node_s: float) -> int:
    """n in 1..len(values_desc) maximising (1 + sum of the n largest values) / (fixed_s + node_s n)
    (the smallest such n on ties); values_desc must be sorted, largest first."""
    if values_desc.numel() == 0:
        return 0
    counts = torch.arange(1, values_desc.numel() + 1, dtype=torch.float64)
    rate = (1 + values_desc.double().cumsum(0)) / (fixed_s + node_s * counts)
    return int(rate.argmax()) + 1


@dataclass(frozen=True)
class VerifyCostCurve:
    """Seconds of one target forward by query tokens, measured at a few lengths."""

    tokens: tuple[int, ...]  # increasing
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.tokens) < 2 or len(self.tokens) != len(self.seconds) or list(self.tokens) != sorted(set(self.tokens)):
            raise ValueError(f"verify cost curve needs >= 2 increasing token counts with one time each, got "
                             f"{self.tokens} / {self.seconds}")

    def marginal_s(self, tokens: int) -> float:
        """Seconds one more query token adds around `tokens`: the least-squares slope over the probed lengths
        up to twice `tokens` (at least two of them), so one noisy timing does not set it; never negative."""
        end = max(bisect.bisect_right(self.tokens, 2 * tokens), 2)
        x = torch.tensor(self.tokens[:end], dtype=torch.float64)
        y = torch.tensor(self.seconds[:end], dtype=torch.float64)
        dx = x - x.mean()
        return max(float((dx * (y - y.mean())).sum() / (dx * dx).sum()), 0.0)

    @classmethod
    def probe(cls, time_forward: Callable[[int], float], token_counts: Sequence[int], repeats: int = 3) -> VerifyCostCurve:
        """Median of `repeats` timings per count, after one untimed warm-up forward per count."""
        counts = sorted(set(token_counts))
        seconds = []
        for n in counts:
            time_forward(n)
            seconds.append(statistics.median(time_forward(n) for _ in range(repeats)))
        return cls(tuple(counts), tuple(seconds))


def probe_token_counts(max_nodes: int, max_batch_tokens: int) -> list[int]:
    """Query lengths to probe: a decode step, half and full tree, then doublings up to the batch's token cap."""
    full = 1 + max_nodes
    counts = {1, 1 + max_nodes // 2, full}
    n = 2 * full
    while n <= max_batch_tokens and n <= 8 * full:
        counts.add(n)
        n *= 2
    return sorted(c for c in counts if c <= max(max_batch_tokens, 2))


def timed(fn: Callable[[], object], synchronize: Callable[[], None] | None = None) -> float:
    """Wall seconds of fn() (synchronize: e.g. torch.cuda.synchronize, so queued kernels are counted)."""
    if synchronize is not None:
        synchronize()
    t0 = time.perf_counter()
    fn()
    if synchronize is not None:
        synchronize()
    return time.perf_counter() - t0


@dataclass
class _Averages:
    round_s: float | None = None  # seconds per speculative round per sequence (step seconds / batch size)
    tokens_per_round: float | None = None  # emitted tokens per round
    nodes_per_round: float = 0.0  # verified draft nodes per round
    query_tokens: int = 1  # query tokens of the last speculative step (where the curve's slope is read)


TREE, CHAIN = "tree", "chain"
SHAPE_RATE_SECONDS = 8   # a shape's round seconds: the median of its latest 8 (a change of cost shows in 5 re-tries)


@dataclass
class ShapeChoice:
    """Tree or chain, by measured seconds per emitted token (the module docstring's "Shape"; the arms and their
    re-tries are speculative.measured_arms')."""

    config: TreeBudgetConfig
    arms: dict[str, ArmCosts] = field(init=False)  # shape -> seconds and tokens per sequence of its latest rounds
    retries: RetryBackoff = field(init=False)      # rounds of the winner between re-tries of the other

    def __post_init__(self) -> None:
        seconds = min(SHAPE_RATE_SECONDS, self.config.shape_window)
        self.arms = {shape: ArmCosts(self.config.shape_window, seconds) for shape in (TREE, CHAIN)}
        self.retries = RetryBackoff(self.config.shape_retry_every, 16 * self.config.shape_retry_every)

    def winner(self) -> str | None:
        """The cheaper shape per token; None until both have their first rounds (a tie keeps the tree)."""
        if any(arm.samples < self.config.shape_min_rounds for arm in self.arms.values()):
            return None
        return CHAIN if self.arms[CHAIN].rate() < self.arms[TREE].rate() else TREE

    def next_shape(self) -> str:
        """Trees first (their calibration needs rounds), then chains, then the winner with a re-try of the other
        every `retries.interval` rounds."""
        for shape in (TREE, CHAIN):
            if self.arms[shape].samples < self.config.shape_min_rounds:
                return shape
        best = self.winner()
        if self.retries.due:
            return CHAIN if best == TREE else TREE
        return best

    def observe(self, shape: str, seconds: float, tokens: float) -> None:
        best = self.winner()
        self.arms[shape].observe(seconds, tokens)
        if best is None:
            return
        if shape == best:
            self.retries.tick()
        elif self.winner() == best:   # a re-try that lost: back off
            self.retries.confirm()
        else:                         # a re-try that won
            self.retries.flip()


@dataclass
class TreeBudget:
    """The shared state a dynamic tree is sized by: calibration, the verify cost curve, measured round costs,
    and whether a tree pays at all against a chain from the same draft."""

    config: TreeBudgetConfig = field(default_factory=TreeBudgetConfig)
    curve: VerifyCostCurve | None = None
    calibration: AcceptanceCalibration = field(init=False)
    averages: _Averages = field(default_factory=_Averages, init=False)
    shape: ShapeChoice = field(init=False)

    def __post_init__(self) -> None:
        self.calibration = AcceptanceCalibration(self.config.prior_accept, self.config.prior_strength)
        self.shape = ShapeChoice(self.config)

    def use_chain(self) -> bool:
        """Whether the next proposal drafts chains instead of trees (the module docstring's "Shape")."""
        return self.shape.next_shape() == CHAIN

    @property
    def measured(self) -> bool:
        return self.curve is not None and self.averages.round_s is not None

    def node_s(self) -> float:
        return 0.0 if self.curve is None else self.curve.marginal_s(self.averages.query_tokens)

    def fixed_s(self) -> float:
        """Seconds of a round that do not scale with its node count (never below a tenth of the round)."""
        avg = self.averages
        round_s = avg.round_s or 0.0
        return max(round_s - self.node_s() * avg.nodes_per_round, 0.1 * round_s, 1e-9)

    def expand_threshold(self) -> float:
        """The value a node needs for one more node to pay for itself: node_s x tokens per second."""
        avg = self.averages
        if not self.measured or not avg.tokens_per_round:
            return 0.0
        return self.node_s() * avg.tokens_per_round / avg.round_s

    def keep_count(self, values_desc: Tensor, max_nodes: int) -> int:
        values = values_desc[:max_nodes]
        if not self.measured:  # nothing measured yet: the configured budget
            return values.numel()
        return best_node_count(values, self.fixed_s(), self.node_s())

    def observe_round(self, cells: Tensor, parents: Tensor, accepted_node_ids: Sequence[int]) -> None:
        self.calibration.observe(cells, parents, accepted_node_ids)

    def observe_step(self, batch_size: int, step_s: float, emitted_tokens: int, query_tokens: int,
                     draft_nodes: int, trees: bool = True) -> None:
        """One pure speculative decode step of `batch_size` sequences (all of them drafted), trees or chains;
        the tree's round averages learn from tree steps only."""
        if batch_size < 1 or step_s <= 0 or emitted_tokens <= 0:
            return
        # per sequence: the shape window and the averages span steps of several batch sizes
        sample = (step_s / batch_size, emitted_tokens / batch_size, draft_nodes / batch_size)
        self.shape.observe(TREE if trees else CHAIN, sample[0], sample[1])
        if not trees:
            return
        avg, w = self.averages, self.config.ema
        if avg.round_s is None:
            avg.round_s, avg.tokens_per_round, avg.nodes_per_round = sample
        else:
            avg.round_s = (1 - w) * avg.round_s + w * sample[0]
            avg.tokens_per_round = (1 - w) * avg.tokens_per_round + w * sample[1]
            avg.nodes_per_round = (1 - w) * avg.nodes_per_round + w * sample[2]
        avg.query_tokens = query_tokens


def probe_verify_costs(executor, block_size: int, num_blocks: int, token_counts: Sequence[int],
                       repeats: int = 3, context: int = 64) -> VerifyCostCurve | None:
    """The target's forward timed at each query length (batch 1, after `context` cached positions).

    Writes K/V into the first blocks of the pool: call it only while no block holds anything (before the
    engine's first forward). None when the pool is too small for the longest probe."""
    from draftsmith.kernels.attention import AttentionMetadata

    counts = [n for n in sorted(set(token_counts)) if context + n <= num_blocks * block_size]
    if len(counts) < 2:
        return None
    device = executor.device

    def time_forward(n: int) -> float:
        table = list(range(-(-(context + n) // block_size)))
        meta = AttentionMetadata.build([n], [context + n], [table], block_size, device)
        ids = torch.ones(n, dtype=torch.int64, device=device)
        positions = torch.arange(context, context + n, device=device)
        rows = torch.arange(n, device=device)
        with torch.inference_mode():
            return timed(lambda: executor.forward(ids, positions, meta, rows), executor.synchronize)

    return VerifyCostCurve.probe(time_forward, counts, repeats)
