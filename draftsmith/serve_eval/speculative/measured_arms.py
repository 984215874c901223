"""Choosing between ways of decoding by what each measurably costs: the one idea behind the batch gate's arms
(speculation capped at K, or plain decoding, per batch size; speculative.batch_gate) and the tree budget's shapes
(tree or chain; speculative.tree_budget).

Each arm's cost is read from its latest measurements (seconds and emitted tokens) through a median: one step on
a shared CPU has spikes of several times its typical cost, which a mean or an EMA would carry for many steps. The
cheapest arm runs; the others are re-tried now and then, in case a change (another draft, longer contexts, another batch mix)
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
    """One arm's measurements: the seconds and emitted tokens of its latest `window` steps (or rounds), and how many
    it ever had. Two readings of them:

    - median(): the median of each measurement's own seconds per token, for arms whose measurements differ in
      size (the batch gate's: one batch-size bucket holds steps of several batch sizes, each read as its own rate);
    - rate(): the median of the latest `rate_seconds` seconds over the mean tokens of the whole window, for arms
      whose measurements cost about the same and yield a varying number of tokens (a speculative round per sequence:
      K sets its cost, acceptance its tokens; a short seconds window follows a change of cost, a long tokens window
      averages acceptance). The median of per-round ratios there is not the rate: with it EAGLE-1 drafted trees in
      38% of its rounds at batch 1 (a chain's rounds of 1-5 tokens put its median per-token cost above its rate) and
      ran at 1.37x of plain decoding against the chain's 1.76x in one interleaved run; read as rate(), 1.72x against
      1.77x (bench_spec --sections trees).
    """

    window: int
    rate_seconds: int | None = None   # rate()'s seconds: the latest this many (None: the whole window)
    seconds: deque = field(init=False)
    tokens: deque = field(init=False)
    samples: int = 0

    def __post_init__(self) -> None:
        if self.window < 1 or not 1 <= (self.rate_seconds or 1) <= self.window:
            raise ValueError(f"an arm's window must be >= 1 and its rate_seconds in [1, window], got {self.window} and "
                             f"{self.rate_seconds}")
        self.seconds = deque(maxlen=self.window)
        self.tokens = deque(maxlen=self.window)

    def observe(self, seconds: float, tokens: float) -> None:
        if tokens <= 0:
            raise ValueError(f"an arm's measurement needs tokens > 0, got {tokens}")
        self.seconds.append(seconds)
        self.tokens.append(tokens)
        self.samples += 1

    def median(self) -> float | None:
        """The median of the latest measurements' seconds per token (None before the first)."""
        return statistics.median(s / t for s, t in zip(self.seconds, self.tokens)) if self.seconds else None

    def rate(self) -> float | None:
        """Seconds per token as the median seconds of the latest measurements over their mean tokens (None before
        the first): the median keeps a spiked step out, the mean counts every token (tokens have no spikes)."""
        if not self.seconds:
            return None
        latest = list(self.seconds)[-(self.rate_seconds or self.window):]
        return statistics.median(latest) / statistics.mean(self.tokens)

    def restart(self) -> None:
        """Forget the window (a fresh burst decides alone); the count of samples stays."""
        self.seconds.clear()
        self.tokens.clear()


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

    def confirm(self) -> None:
        """The re-tries confirmed the winner: wait twice as long before the next."""
        self.interval, self.since = min(2 * self.interval, self.cap), 0

    def flip(self) -> None:
        """A re-tried arm won: back to the base interval."""
        self.interval, self.since = self.base, 0
