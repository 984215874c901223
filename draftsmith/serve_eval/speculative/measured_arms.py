"""Choosing between ways of decoding by what each measurably costs: the one idea behind the batch gate's arms
(speculation capped at K, or plain decoding, per batch size; speculative.batch_gate) and the tree budget's shapes
(tree or chain; speculative.tree_budget).

Each arm's cost is the median of its latest measurements (seconds per emitted token): one step on a shared CPU
has spikes of several times its typical cost, which a mean or an EMA would carry for many steps. The cheapest arm
runs; the others are re-tried now and then, in case a change (another draft, longer contexts, another batch mix)
made one of them cheaper. How often is a RetryBackoff: a base interval in steps of the winner, doubled each time
the re-tries confirm the winner (up to a cap), back to the base when one wins, so an arm that keeps losing costs
ever less to watch.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field


@dataclass
class ArmCosts:
    """One arm's measurements: the latest `window` costs (seconds per emitted token) and how many it ever had."""

    window: int
    recent: deque = field(init=False)
    samples: int = 0

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"an arm's window must be >= 1, got {self.window}")
        self.recent = deque(maxlen=self.window)

    def observe(self, seconds_per_token: float) -> None:
        self.recent.append(seconds_per_token)
        self.samples += 1

    def median(self) -> float | None:
        """The arm's cost: the median of its latest measurements (None before the first)."""
        return statistics.median(self.recent) if self.recent else None

    def restart(self) -> None:
        """Forget the window (a fresh burst decides alone); the count of samples stays."""
        self.recent.clear()


@dataclass
class RetryBackoff:
    """Steps of the winning arm between re-tries of the others: `base` at first, doubled by `confirm` up to `cap`,
    back to `base` on `flip`; every re-try that ends restarts the count."""

    base: int
    cap: int
    interval: int = field(init=False)
    since: int = 0   # steps of the winner since the last re-try ended

    def __post_init__(self) -> None:
        if not 1 <= self.base <= self.cap:
            raise ValueError(f"re-try interval: 1 <= base <= cap, got base {self.base}, cap {self.cap}")
        self.interval = self.base

    def tick(self) -> None:
        self.since += 1

    @property
    def due(self) -> bool:
        return self.since >= self.interval

    def restart(self) -> None:
        """A re-try ended without deciding the interval (the gate's turn of re-tries is not complete yet)."""
        self.since = 0

    def confirm(self) -> None:
        """The re-tries confirmed the winner: wait twice as long before the next."""
        self.interval, self.since = min(2 * self.interval, self.cap), 0

    def flip(self) -> None:
        """A re-tried arm won: back to the base interval."""
        self.interval, self.since = self.base, 0
