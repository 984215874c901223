"""Speculate only where it pays at the current batch size.

A speculative round multiplies the tokens of a target forward by (1 + K) per sequence; at batch 1
that is nearly free (the step is memory-bound), at batch 16 or 32 it is not, and a round can cost
more than the tokens it saves. The gate caps K by batch size, in one of two ways:

- `table`: K caps per batch size, as vLLM's `num_speculative_tokens_per_batch_size`
  ({1: 4, 8: 2, 16: 0} = up to batch 1: K <= 4; up to 8: K <= 2; beyond: no speculation);
- `measured` (the default): per batch-size bucket, the engine's own measured seconds per emitted
  token of speculative steps and of plain steps (EMAs); the faster arm runs, the other is re-tried
  after `explore_every` steps of the bucket so that a change (another draft, longer contexts) is seen.
  Each re-try that confirms the winner doubles that interval (up to `max_explore_every`): a losing arm
  costs a share that shrinks from 1/16 towards 1/256 of the steps, while a flip resets the interval.
  An arm with fewer than `min_samples` steps in a bucket is measured first.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

MODES = ("off", "table", "measured")
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)   # upper bounds of the batch-size buckets


@dataclass
class BatchGateConfig:
    mode: str = "measured"
    k_by_batch_size: dict[int, int] = field(default_factory=dict)   # table mode
    explore_every: int = 16
    max_explore_every: int = 256
    min_samples: int = 3
    ema: float = 0.2
    margin: float = 0.02      # speculation must be this much faster per token to be kept

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"batch_gate.mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "table" and not self.k_by_batch_size:
            raise ValueError("batch_gate.k_by_batch_size: table mode needs at least one {batch_size: K} entry")
        for size, k in self.k_by_batch_size.items():
            if int(size) < 1 or int(k) < 0:
                raise ValueError(f"batch_gate.k_by_batch_size[{size}] = {k}: sizes >= 1, K caps >= 0")
        if self.explore_every < 2 or self.max_explore_every < self.explore_every or self.min_samples < 1 \
                or not 0 < self.ema <= 1 or self.margin < 0:
            raise ValueError("batch_gate: 2 <= explore_every <= max_explore_every, min_samples >= 1, "
                             "ema in (0, 1], margin >= 0")


@dataclass
class _Arm:
    seconds_per_token: float | None = None
    samples: int = 0

    def observe(self, value: float, weight: float) -> None:
        self.seconds_per_token = value if self.seconds_per_token is None else (
            (1 - weight) * self.seconds_per_token + weight * value)
        self.samples += 1


@dataclass
class _Bucket:
    speculative: _Arm = field(default_factory=_Arm)
    plain: _Arm = field(default_factory=_Arm)
    steps: int = 0
    explore_interval: int = 0      # steps of the winning arm between re-tries of the other (0: not set yet)
    steps_since_explore: int = 0


class BatchGate:
    def __init__(self, config: BatchGateConfig | None = None) -> None:
        self.config = config or BatchGateConfig()
        self._table = sorted((int(s), int(k)) for s, k in self.config.k_by_batch_size.items())
        self._buckets: dict[int, _Bucket] = {}

    @staticmethod
    def bucket_of(batch_size: int) -> int:
        i = bisect.bisect_left(BUCKETS, batch_size)
        return BUCKETS[min(i, len(BUCKETS) - 1)]

    def cap(self, batch_size: int) -> int | None:
        """The K cap for a step of `batch_size` decoding sequences (0: decode plainly; None: no cap)."""
        if self.config.mode == "off" or batch_size < 1:
            return None
        if self.config.mode == "table":
            for size, k in self._table:
                if batch_size <= size:
                    return k
            return self._table[-1][1]
        return None if self._speculate(self._buckets.setdefault(self.bucket_of(batch_size), _Bucket())) else 0

    def _winner(self, b: _Bucket) -> bool | None:
        """True: speculation is faster here; False: plain decoding; None: an arm is still being measured."""
        if b.speculative.samples < self.config.min_samples or b.plain.samples < self.config.min_samples:
            return None
        return b.speculative.seconds_per_token < b.plain.seconds_per_token * (1 - self.config.margin)

    def _speculate(self, b: _Bucket) -> bool:
        if b.speculative.samples < self.config.min_samples:
            return True
        winner = self._winner(b)
        if winner is None:
            return False
        explore = b.steps_since_explore >= (b.explore_interval or self.config.explore_every) - 1
        return winner != explore

    def observe_step(self, batch_size: int, speculative: bool, step_s: float, emitted_tokens: int) -> None:
        """One engine step of `batch_size` decoding sequences: its wall time and the tokens it emitted."""
        if self.config.mode != "measured" or batch_size < 1 or emitted_tokens <= 0 or step_s <= 0:
            return
        b = self._buckets.setdefault(self.bucket_of(batch_size), _Bucket())
        before = self._winner(b)
        b.steps += 1
        # A re-try of the losing arm replaces its estimate: that one is as old as the last re-try, and
        # averaged in at `ema` a real improvement would take several (ever rarer) re-tries to show.
        retry = before is not None and speculative != before
        (b.speculative if speculative else b.plain).observe(step_s / emitted_tokens, 1.0 if retry else self.config.ema)
        after = self._winner(b)
        if before is None or after is None:
            return
        if speculative == before:       # a step of the winning arm
            b.steps_since_explore += 1
            return
        # a re-try of the losing arm: it lost again -> re-try half as often; it won -> back to the base rate
        cfg = self.config
        b.explore_interval = (min(2 * (b.explore_interval or cfg.explore_every), cfg.max_explore_every)
                              if after == before else cfg.explore_every)
        b.steps_since_explore = 0

    def to_dict(self) -> dict:
        return {str(size): {"speculate": self._speculate(b), "spec_s_per_token": b.speculative.seconds_per_token,
                            "plain_s_per_token": b.plain.seconds_per_token, "steps": b.steps}
                for size, b in sorted(self._buckets.items())}
