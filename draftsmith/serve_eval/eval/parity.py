"""Training-to-serving parity: what a draft's training run predicted against what serving measured.

A distillation run ends with held-out per-position accuracies acc_k (the draft's k-th token matching
the target's, given the k-1 before it matched) and the tau a chain with those rates would give
(`simulated_tau`). The eval measures the served a_k and tau of the same draft at the same K. When
serving falls short of training by more than `GAP_THRESHOLD` in tau, the row is flagged with the
likeliest cause, read from what the draft and the row record:

- positions beyond those trained (TTT unroll / heads shorter than the K served);
- sampling at serve time where the training-time figure is a greedy one (temperature mismatch);
- a reduced draft vocabulary that covers too little of the target's tokens (EAGLE-3);
- too few training steps for the figure to mean much;
- otherwise, a shift between the training prompts and the served ones.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from draftsmith.serve_eval.eval.report import ResultRow
from draftsmith.serve_eval.speculative.metrics import simulated_tau

GAP_THRESHOLD = 0.5        # tau: served below simulated by more than this is flagged
MIN_COVERAGE = 0.95        # EAGLE-3 reduced vocabulary: token mass it should cover
MIN_STEPS = 100


@dataclass(frozen=True)
class TrainingFigures:
    accuracies: list[float]            # held-out acc_k, k = 1.. (draftsmith.json metrics eval/acc_posK)
    steps: int | None = None
    vocab_coverage: float | None = None

    @classmethod
    def from_draft_dir(cls, draft_dir: str | Path) -> "TrainingFigures | None":
        meta_path = Path(draft_dir) / "draftsmith.json"
        if not meta_path.is_file():
            return None
        metrics = json.loads(meta_path.read_text()).get("metrics") or {}
        accuracies = []
        while f"eval/acc_pos{len(accuracies) + 1}" in metrics:
            accuracies.append(float(metrics[f"eval/acc_pos{len(accuracies) + 1}"]))
        if not accuracies:
            return None
        steps = metrics.get("steps")
        return cls(accuracies, int(steps) if steps is not None else None, metrics.get("draft_vocab_coverage"))


@dataclass(frozen=True)
class ParityRow:
    method: str
    domain: str
    K: int
    temperature: float
    trained_positions: int
    simulated_tau: float               # over the first K trained positions
    served_tau: float
    gap: float                         # simulated - served
    flag: str | None                   # the likeliest cause, when gap > GAP_THRESHOLD

    def to_dict(self) -> dict:
        return asdict(self)


def likely_cause(row: ResultRow, figures: TrainingFigures) -> str:
    if row.K > len(figures.accuracies):
        return (f"K={row.K} is longer than the {len(figures.accuracies)} positions trained (TTT unroll or heads): "
                "train as many as the K served")
    if row.temperature > 0:
        return f"temperature mismatch: served at T={row.temperature:g}, the training figure is greedy acceptance"
    if figures.vocab_coverage is not None and figures.vocab_coverage < MIN_COVERAGE:
        return f"draft vocabulary covers {figures.vocab_coverage:.1%} of the target's tokens: enlarge it"
    if figures.steps is not None and figures.steps < MIN_STEPS:
        return f"too little training ({figures.steps} steps)"
    return "shift between the training prompts and the served ones (more, or more representative, data)"


def parity_rows(results: list[ResultRow], drafts: dict[str, str]) -> list[ParityRow]:
    """One row per served (method, domain, K, temperature) of a draft whose training figures are known."""
    figures = {method: TrainingFigures.from_draft_dir(path) for method, path in drafts.items()}
    out = []
    for row in results:
        fig = figures.get(row.method)
        if fig is None or row.tau is None or row.K < 1:
            continue
        predicted = simulated_tau(fig.accuracies[:row.K])
        gap = predicted - row.tau
        out.append(ParityRow(row.method, row.domain, row.K, row.temperature, len(fig.accuracies), predicted,
                             row.tau, gap, likely_cause(row, fig) if gap > GAP_THRESHOLD else None))
    return out
