"""The definitions of the speculative-decoding metrics; nothing else computes them.

- Round: one target verification forward for one sequence.
- alpha = accepted draft tokens / proposed draft tokens.
- tau = tokens emitted per round, bonus token included = 1 + accepted / rounds.
- a_k = rounds whose k-th draft token was accepted / rounds that proposed a k-th token.
  For a tree, "the k-th draft token" is the depth-k node: a round proposes one when the tree reaches
  depth k, and accepts it when the accepted path has length >= k.
- ms/token = wall time of the decode phase / tokens generated in it (prefill excluded; TTFT apart).
- speedup = baseline ms/token / method ms/token (same engine, prompts and params, one run).
- simulated tau (training-time estimate) = 1 + sum_k prod_{j<=k} acc_j from per-position draft
  accuracies, the tau a chain with these conditional acceptance rates would give.
- predicted speedup (seed formula) = (1 + K * alpha) / (1 + K * c), c = draft step cost / target step
  cost. Measured c = (draft time per proposed token) / (target time per round).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


def predicted_speedup(k: float, alpha: float, cost_ratio: float) -> float:
    """Seed formula (1 + K alpha) / (1 + K c)."""
    return (1 + k * alpha) / (1 + k * cost_ratio)


def expected_speedup(k: int, beta: float, cost_ratio: float) -> float:
    """Under i.i.d. per-token acceptance beta (Leviathan et al.): expected tokens per round over the
    round's cost, (1 - beta^(K+1)) / ((1 - beta)(1 + K c)); the K+1 limit at beta = 1. Unlike the seed
    formula it has an interior optimum in K, which is what the adaptive policy maximizes."""
    tokens = k + 1 if beta >= 1 else (1 - beta ** (k + 1)) / (1 - beta)
    return tokens / (1 + k * cost_ratio)


def break_even_alpha(alpha: float, tau: float, speedup: float) -> float:
    """The alpha at which a draft measured at (alpha, tau, speed-up) stops paying. A round's cost is fixed by
    the draft and the verify forward, so the speed-up scales with tokens per round, tau = 1 + n alpha (n:
    draft tokens proposed per round, K for full chains; fewer for n-gram misses and rounds cut at
    max_tokens, hence n = (tau - 1) / alpha rather than K). It reaches 1 where 1 + n alpha' = tau / speedup,
    so alpha' = alpha (tau / speedup - 1) / (tau - 1). Clamped to [0, 1]; 0 where nothing was accepted."""
    if speedup <= 0 or tau < 1:
        raise ValueError(f"break_even_alpha needs speedup > 0 and tau >= 1, got speedup={speedup}, tau={tau}")
    if tau == 1 or alpha <= 0:
        return 0.0
    return min(1.0, max(0.0, alpha * (tau / speedup - 1) / (tau - 1)))


def simulated_tau(position_accuracies: Sequence[float]) -> float:
    """Mean accepted length a chain of these per-position acceptance rates would give.

    tau = 1 + sum_k prod_{j<=k} acc_j: draft token k is emitted only if tokens 1..k all pass (accuracies
    treated as conditional acceptance rates, independent across positions), and the verify step always
    adds the bonus/correction token (the 1). The distill trainer logs it from held-out top-1 agreement
    so acceptance can be watched while training; it estimates the measured tau above.
    """
    tau, survive = 1.0, 1.0
    for accuracy in position_accuracies:
        if not 0.0 <= accuracy <= 1.0:
            raise ValueError(f"position accuracy {accuracy} outside [0, 1]")
        survive *= accuracy
        tau += survive
    return tau


def ms_per_token(decode_wall_s: float, num_tokens: int) -> float:
    """Decode-phase milliseconds per generated token (nan when nothing was generated)."""
    return 1000.0 * decode_wall_s / num_tokens if num_tokens > 0 else math.nan


def request_ms_per_token(first_token_time: float, last_token_time: float, num_output_tokens: int) -> float:
    """Per request: the first token comes from prefill (TTFT), the other n - 1 from decode."""
    return ms_per_token(last_token_time - first_token_time, num_output_tokens - 1)


def speedup(baseline_ms_per_token: float, method_ms_per_token: float) -> float:
    return baseline_ms_per_token / method_ms_per_token if method_ms_per_token > 0 else math.nan


def percentile(values: Sequence[float], q: float) -> float:
    """q in [0, 100], linear interpolation between order statistics (numpy's default); nan if empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    ordered = sorted(values)
    if not ordered:
        return math.nan
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def latency_summary(values: Sequence[float]) -> dict[str, float]:
    """mean / p50 / p99 of latencies (TTFT, ITL, per-request ms/token)."""
    mean = sum(values) / len(values) if values else math.nan
    return {"mean": mean, "p50": percentile(values, 50), "p99": percentile(values, 99), "count": len(values)}


@dataclass
class SpecStats:
    """Counters of speculative rounds; mergeable (per request, per domain, totals)."""

    num_rounds: int = 0
    num_proposed: int = 0
    num_accepted: int = 0
    draft_time_s: float = 0.0
    target_time_s: float = 0.0
    proposed_by_position: list[int] = field(default_factory=list)  # [k-1]: rounds that proposed a k-th token
    accepted_by_position: list[int] = field(default_factory=list)  # [k-1]: rounds that accepted their k-th token

    def record_round(
        self,
        num_proposed: int,
        num_accepted: int,
        draft_time: float = 0.0,
        target_time: float = 0.0,
        num_positions: int | None = None,
    ) -> None:
        """One verification round. num_positions: deepest draft position (tree depth); defaults to
        num_proposed, which is right for chains."""
        num_positions = num_proposed if num_positions is None else num_positions
        if num_proposed < 0 or not 0 <= num_accepted <= num_positions <= num_proposed:
            raise ValueError(
                f"round needs 0 <= num_accepted ({num_accepted}) <= num_positions ({num_positions}) "
                f"<= num_proposed ({num_proposed})"
            )
        if draft_time < 0 or target_time < 0:
            raise ValueError(f"round times must be >= 0, got draft_time {draft_time}, target_time {target_time}")
        self.num_rounds += 1
        self.num_proposed += num_proposed
        self.num_accepted += num_accepted
        self.draft_time_s += draft_time
        self.target_time_s += target_time
        _grow(self.proposed_by_position, num_positions)
        _grow(self.accepted_by_position, num_positions)
        for k in range(num_positions):
            self.proposed_by_position[k] += 1
        for k in range(num_accepted):
            self.accepted_by_position[k] += 1

    def add_time(self, draft_time: float = 0.0, target_time: float = 0.0) -> None:
        """Times measured for a whole batch step can be charged apart from the per-round counters."""
        self.draft_time_s += draft_time
        self.target_time_s += target_time

    def minus(self, before: SpecStats) -> SpecStats:
        """self - before, for cumulative counters read twice (a server's /metrics around a run)."""
        width = max(len(self.proposed_by_position), len(before.proposed_by_position),
                    len(self.accepted_by_position), len(before.accepted_by_position))
        pad = lambda xs: list(xs) + [0] * (width - len(xs))  # noqa: E731
        return SpecStats(self.num_rounds - before.num_rounds, self.num_proposed - before.num_proposed,
                         self.num_accepted - before.num_accepted, self.draft_time_s - before.draft_time_s,
                         self.target_time_s - before.target_time_s,
                         [a - b for a, b in zip(pad(self.proposed_by_position), pad(before.proposed_by_position))],
                         [a - b for a, b in zip(pad(self.accepted_by_position), pad(before.accepted_by_position))])

    def merge(self, other: SpecStats) -> SpecStats:
        """In place; returns self so totals can be folded: functools.reduce(SpecStats.merge, ...)."""
        self.num_rounds += other.num_rounds
        self.num_proposed += other.num_proposed
        self.num_accepted += other.num_accepted
        self.draft_time_s += other.draft_time_s
        self.target_time_s += other.target_time_s
        for mine, theirs in ((self.proposed_by_position, other.proposed_by_position),
                             (self.accepted_by_position, other.accepted_by_position)):
            _grow(mine, len(theirs))
            for k, count in enumerate(theirs):
                mine[k] += count
        return self

    @classmethod
    def merged(cls, parts: Iterable[SpecStats]) -> SpecStats:
        total = cls()
        for part in parts:
            total.merge(part)
        return total

    @property
    def alpha(self) -> float:
        return self.num_accepted / self.num_proposed if self.num_proposed else math.nan

    @property
    def tau(self) -> float:
        return 1 + self.num_accepted / self.num_rounds if self.num_rounds else math.nan

    @property
    def num_emitted(self) -> int:
        return self.num_accepted + self.num_rounds

    @property
    def acceptance_by_position(self) -> list[float]:
        """a_k for k = 1..max position."""
        pairs = zip(self.accepted_by_position, self.proposed_by_position)
        return [acc / prop if prop else math.nan for acc, prop in pairs]

    @property
    def mean_k(self) -> float:
        return self.num_proposed / self.num_rounds if self.num_rounds else math.nan

    @property
    def cost_ratio(self) -> float:
        """c = draft time per proposed token / target time per round."""
        if not self.num_proposed or not self.target_time_s:
            return math.nan
        return (self.draft_time_s / self.num_proposed) / (self.target_time_s / self.num_rounds)

    def predicted_speedup(self) -> float:
        return predicted_speedup(self.mean_k, self.alpha, self.cost_ratio)

    def to_dict(self) -> dict:
        return {
            "rounds": self.num_rounds,
            "proposed": self.num_proposed,
            "accepted": self.num_accepted,
            "emitted": self.num_emitted,
            "alpha": self.alpha,
            "tau": self.tau,
            "mean_k": self.mean_k,
            "acceptance_by_position": self.acceptance_by_position,
            "proposed_by_position": list(self.proposed_by_position),
            "accepted_by_position": list(self.accepted_by_position),
            "draft_time_s": self.draft_time_s,
            "target_time_s": self.target_time_s,
            "cost_ratio": self.cost_ratio,
            "predicted_speedup": self.predicted_speedup(),
        }




def _grow(counts: list[int], length: int) -> None:
    if len(counts) < length:
        counts.extend([0] * (length - len(counts)))


DEFAULT_DOMAIN = "default"


@dataclass
class SpecMetrics:
    """Per request, per domain label and overall (positions live inside each SpecStats)."""

    total: SpecStats = field(default_factory=SpecStats)
    by_domain: dict[str, SpecStats] = field(default_factory=dict)
    by_request: dict[str, SpecStats] = field(default_factory=dict)

    def record_round(
        self,
        request_id: str,
        domain: str | None,
        num_proposed: int,
        num_accepted: int,
        draft_time: float = 0.0,
        target_time: float = 0.0,
        num_positions: int | None = None,
    ) -> None:
        domain = domain or DEFAULT_DOMAIN
        for stats in (self.total, self.by_domain.setdefault(domain, SpecStats()),
                      self.by_request.setdefault(request_id, SpecStats())):
            stats.record_round(num_proposed, num_accepted, draft_time, target_time, num_positions)

    def add_step_time(self, draft_time: float, target_time: float, domain_shares: dict[str, float]) -> None:
        """Charge one batched step's times to the total and to domains by share (shares sum to 1)."""
        self.total.add_time(draft_time, target_time)
        for domain, share in domain_shares.items():
            stats = self.by_domain.setdefault(domain or DEFAULT_DOMAIN, SpecStats())
            stats.add_time(draft_time * share, target_time * share)

    def pop_request(self, request_id: str) -> SpecStats | None:
        """Finished requests leave the live map (their counts stay in domain and total)."""
        return self.by_request.pop(request_id, None)

    def merge(self, other: SpecMetrics) -> SpecMetrics:
        self.total.merge(other.total)
        for mine, theirs in ((self.by_domain, other.by_domain), (self.by_request, other.by_request)):
            for key, stats in theirs.items():
                mine.setdefault(key, SpecStats()).merge(stats)
        return self

    def to_dict(self) -> dict:
        return {
            "total": self.total.to_dict(),
            "by_domain": {domain: stats.to_dict() for domain, stats in sorted(self.by_domain.items())},
        }


@dataclass
class SpecEngineStats:
    """What a speculative engine reports (EngineStats.spec): THE counters, overall and per domain, and
    the state of the policies deciding K. Servers, the eval and benchmarks read these fields directly."""

    method: str
    total: SpecStats
    by_domain: dict[str, SpecStats]
    policy: dict[str, dict]                    # SpecPolicy.to_dict(): per domain enabled / K / running alpha
    batch_gate: dict[str, dict]                # BatchGate.to_dict(): per batch-size bucket
    rounds_by_draft: dict[tuple[str, str], int] = field(default_factory=dict)   # (domain, method): routed
    draft_time_s: float = 0.0
    target_time_s: float = 0.0

    def to_dict(self) -> dict:
        return {"method": self.method, "total": self.total.to_dict(),
                "by_domain": {d: s.to_dict() for d, s in sorted(self.by_domain.items())},
                "policy": self.policy, "batch_gate": self.batch_gate,
                "rounds_by_draft": {f"{d}/{m}": n for (d, m), n in sorted(self.rounds_by_draft.items())},
                "draft_time_s": self.draft_time_s, "target_time_s": self.target_time_s}
