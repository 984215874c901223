"""Speculate only as far as pays at the current batch size.

A speculative round multiplies the tokens of a target forward by (1 + K) per sequence; at batch 1
that is nearly free (the step is memory-bound), at batch 16 or 32 it is not, and a round of K=4 can
cost more than the tokens it saves while a round of K=1 still gains. The gate caps K by batch size,
in one of two ways:

- `table`: K caps per batch size, as vLLM's `num_speculative_tokens_per_batch_size`
  ({1: 4, 8: 2, 16: 0} = up to batch 1: K <= 4; up to 8: K <= 2; beyond: no speculation);
- `measured` (the default): per batch-size bucket, a few arms -- no cap (the policy's K), the caps in
  `k_caps` (K <= 1, K <= 2) and plain decoding (cap 0) -- each with the engine's own measured seconds
  per emitted token. The cheapest arm runs (a speculative one only if it beats plain decoding by
  `margin`). The others are re-tried now and then, so that a change (another draft, longer contexts) is seen:
  each after `explore_every` steps of the winner at first, each re-try that confirms the winner doubling that
  arm's own interval (up to `max_explore_every`), a flip resetting every arm's. (One interval for a turn of all
  the losers held a near-winner up behind the dear arms' waits.) Every arm starts with `min_samples`
  steps, plain decoding first, then the caps from the smallest K up: when K <= k loses to plain decoding,
  the arms of larger K are presumed to lose by as much and are not run until their re-try comes. (A round's
  work grows with K about linearly once the batch is compute-bound, while its extra tokens grow by less:
  a K that does not pay at K = 1 pays less at K = 4. Measuring the uncapped arm first spent the first steps
  of every large bucket on its dearest arm.)

  A re-try also waits until it is affordable: its expected extra cost (its steps times how much dearer per
  token the arm is than the winner) at most its share of `explore_overhead` (the budget of all the losers
  together) of the winner's steps since its last one. A draft that runs only while speculating pays a catch-up
  over every token decoded plainly since (at its start: over every prompt), so the first step of a speculative
  run is several times dearer than its rounds; at batch 16 the interval's re-tries alone cost 5-8% on 64-token
  answers. So while plain decoding wins, a speculative arm's re-try also counts the draft's catch-up: the dearest
  first step of a run the bucket has seen, beyond its arm's own rate (one draft serves every cap; the dearest,
  because a re-try that closely follows a sibling's catches up on little, and timing the next ones by it
  re-tried every arm within ~120 steps), with no deadline short of `max_retry_wait`. A per-token median hides
  the one dear step that carries the catch-up. An arm that never ran (presumed from a smaller K's loss) is not
  hurried either: its first re-try, timed by the interval cap alone, cost 4% of the first 260 steps of a
  batch-16 bucket (scripted catch-ups of 3 plain steps).

  Estimates are medians of an arm's last `window` steps (the arms and the re-try interval are
  speculative.measured_arms', which the tree budget's tree-or-chain choice shares), because one step's cost on a shared CPU has
  spikes of several times its typical value. A re-try is one step; if that step would make the arm the
  winner, the re-try extends to a burst of `min_samples` steps whose median alone (fresh) decides. So a
  spike can neither keep a losing arm from being re-tried in earnest nor promote one. (With an EMA and
  one-step re-tries that replaced the estimate, one spike on plain decoding's re-try left its estimate
  at about 3x its cost, and the gate ran speculation at 0.95x of plain decoding at batch 16.) A burst that
  would win is then checked against a fresh burst of the winner, and so is speculation's first win against
  plain decoding: the load drifts, and a window from a slower stretch is no match for fresh steps.

Measured on the embedded target at batch 16 (standalone draft, K=4, 32 prompts x 64 tokens, T=0):
every round at K=4 0.82x of plain decoding, K <= 1 1.02x, K <= 2 0.99x; the old two-arm gate (K=4 or
plain) 0.95x.
"""
from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from draftsmith.serve_eval.speculative.measured_arms import ArmCosts, RetryBackoff

MODES = ("off", "table", "measured")
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)   # upper bounds of the batch-size buckets
PLAIN = 0        # the arm that decodes plainly (cap 0)
UNCAPPED = -1    # the arm key of "no cap": the policy's own K
CATCH_UPS = 4    # catch-ups a bucket remembers: a spike or an old context ages out after a few runs
CATCH_UP_STEP = 2.0   # a re-try's first step this many times its arm's rate per token carried a catch-up


@dataclass
class BatchGateConfig:
    mode: str = "measured"
    k_by_batch_size: dict[int, int] = field(default_factory=dict)   # table mode
    k_caps: tuple[int, ...] = (1, 2)   # measured mode: the capped arms tried beside no cap and plain decoding
    explore_every: int = 16
    max_explore_every: int = 256
    min_samples: int = 3      # steps of a first measurement, and of a re-try burst that may flip the winner
    window: int = 8           # an arm's estimate: the median of its last `window` steps
    margin: float = 0.01      # a speculative arm must be this much faster per token than plain decoding
    explore_overhead: float = 0.01   # the re-tries of all losing arms together cost at most about this share of the
                                     # winner's steps: each waits until its expected extra cost is at most this share
                                     # over the number of losers (3 arms 1.6x dearer: one step of each per 180)
    max_retry_wait: int = 2048       # ... but at most this many steps where that cost was measured (a catch-up is
                                     # bounded by the batch's live context, so a longer wait dilutes it)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"batch_gate.mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "table" and not self.k_by_batch_size:
            raise ValueError("batch_gate.k_by_batch_size: table mode needs at least one {batch_size: K} entry")
        for size, k in self.k_by_batch_size.items():
            if int(size) < 1 or int(k) < 0:
                raise ValueError(f"batch_gate.k_by_batch_size[{size}] = {k}: sizes >= 1, K caps >= 0")
        self.k_caps = tuple(sorted({int(k) for k in self.k_caps}))
        if any(k < 1 for k in self.k_caps):
            raise ValueError(f"batch_gate.k_caps = {list(self.k_caps)}: caps are >= 1 (plain decoding is always an arm)")
        if self.explore_every < 2 or self.max_explore_every < self.explore_every or self.min_samples < 1 \
                or self.window < self.min_samples or self.margin < 0 or not 0 < self.explore_overhead <= 1 \
                or self.max_retry_wait < self.max_explore_every:
            raise ValueError("batch_gate: 2 <= explore_every <= max_explore_every <= max_retry_wait, "
                             "1 <= min_samples <= window, margin >= 0, 0 < explore_overhead <= 1")


@dataclass
class _Arm(ArmCosts):
    """An arm's measured costs (speculative.measured_arms), and what the gate presumes or learned of its re-tries."""

    presumed_ratio: float | None = None   # its cost / plain decoding's, presumed from a smaller K's loss


@dataclass
class _Bucket:
    arms: dict[int, _Arm]          # arm key (UNCAPPED, a cap in k_caps, PLAIN) -> its cost per token
    retries: dict[int, RetryBackoff]   # per arm: steps of the winner between its re-tries, and since its last one
    steps: int = 0
    retry_arm: int | None = None   # the arm of the re-try burst under way
    retry_left: int = 0            # its steps still to run
    retry_burst: bool = False      # the re-try's first step would have won: confirming on fresh steps
    retry_from: int | None = None  # the winner when the re-try began
    confirming: int | None = None  # an arm whose fresh burst beat the winner's window, while the winner's fresh burst runs
    decided: bool = False          # every arm has been measured once (the first decision was checked)
    # the draft's catch-up (one draft serves every cap): the dearest of the latest CATCH_UPS first steps of a
    # speculative arm's run (its start, or a re-try after plain decoding), in seconds beyond that arm's own rate
    catch_ups: deque = field(default_factory=lambda: deque(maxlen=CATCH_UPS))
    run_start: tuple[int, float, int] | None = None   # (arm, seconds, tokens) of such a first step, until the arm's
                                                      # own rate is known to tell its catch-up from its rounds
    winner_step_s: deque = field(default_factory=lambda: deque(maxlen=16))  # seconds of the winner's latest steps

    def cost(self, key: int) -> float | None:
        """Seconds per token of an arm: the median of its latest steps; before it has run, its presumed
        ratio times plain decoding's cost; None if neither is known."""
        arm = self.arms[key]
        if arm.seconds:
            return arm.median()
        plain = self.arms[PLAIN].median()
        if arm.presumed_ratio is not None and plain is not None:
            return arm.presumed_ratio * plain
        return None

    def measured(self, key: int, min_samples: int) -> bool:
        arm = self.arms[key]
        return arm.samples >= min_samples or arm.presumed_ratio is not None


class BatchGate:
    def __init__(self, config: BatchGateConfig | None = None) -> None:
        self.config = config or BatchGateConfig()
        self._table = sorted((int(s), int(k)) for s, k in self.config.k_by_batch_size.items())
        self._arm_keys = (UNCAPPED, *self.config.k_caps, PLAIN)   # of equal costs the first wins: the policy's K
        self._measure_order = (PLAIN, *self.config.k_caps, UNCAPPED)   # K ascending
        self._buckets: dict[int, _Bucket] = {}

    @staticmethod
    def bucket_of(batch_size: int) -> int:
        i = bisect.bisect_left(BUCKETS, batch_size)
        return BUCKETS[min(i, len(BUCKETS) - 1)]

    def _bucket(self, batch_size: int) -> _Bucket:
        size = self.bucket_of(batch_size)
        if size not in self._buckets:
            cfg = self.config
            self._buckets[size] = _Bucket({key: _Arm(cfg.window) for key in self._arm_keys},
                                          {key: RetryBackoff(cfg.explore_every, cfg.max_explore_every)
                                           for key in self._arm_keys})
        return self._buckets[size]

    def cap(self, batch_size: int) -> int | None:
        """The K cap for a step of `batch_size` decoding sequences (0: decode plainly; None: no cap)."""
        if self.config.mode == "off" or batch_size < 1:
            return None
        if self.config.mode == "table":
            for size, k in self._table:
                if batch_size <= size:
                    return k
            return self._table[-1][1]
        key = self._choose(self._bucket(batch_size))
        return None if key == UNCAPPED else key

    def _winner(self, b: _Bucket) -> int | None:
        """The cheapest arm per token (a speculative one only by `margin`); None while one is unmeasured."""
        if not all(b.measured(key, self.config.min_samples) for key in b.arms):
            return None
        best = min(b.arms, key=b.cost)
        return best if b.cost(best) < b.cost(PLAIN) * (1 - self.config.margin) else PLAIN

    def _choose(self, b: _Bucket) -> int:
        """The arm of the next step; a pure function of the bucket's state (cap and observe_step agree)."""
        for key in self._measure_order:
            if not b.measured(key, self.config.min_samples):
                return key
        if b.retry_left:
            return b.retry_arm
        return self._winner(b)

    def observe_step(self, batch_size: int, speculative: bool, step_s: float, emitted_tokens: int) -> None:
        """One engine step of `batch_size` decoding sequences: whether it ran rounds, its wall time and the
        tokens it emitted. It is booked to the arm `cap` chose; a step that ran no round under a speculative
        cap (no sequence had room for a draft) is a plain step and only updates plain decoding's cost."""
        if self.config.mode != "measured" or batch_size < 1 or emitted_tokens <= 0 or step_s <= 0:
            return
        b = self._bucket(batch_size)
        chosen = self._choose(b)
        if not speculative and chosen != PLAIN:
            b.arms[PLAIN].observe(step_s, emitted_tokens)
            return
        b.steps += 1
        if b.retry_left:
            self._retry_step(b, step_s, emitted_tokens)
            return
        if chosen != PLAIN and not b.arms[chosen].samples:   # the draft's start: its catch-up over every prompt
            b.run_start = (chosen, step_s, emitted_tokens)
        b.arms[chosen].observe(step_s, emitted_tokens)
        self._note_catch_up(b)
        self._presume_larger_k(b, chosen)
        winner = self._winner(b)
        if winner is None:
            return
        if not b.decided:
            b.decided = True
            # plain decoding was measured first, longest ago: it runs again before speculation wins
            if winner != PLAIN and self.config.min_samples > 1:
                self._confirm_against(b, challenger=winner, incumbent=PLAIN)
                return
        if chosen == winner:
            b.winner_step_s.append(step_s)
        losers = [key for key in b.arms if key != winner]
        for key in losers:
            b.retries[key].tick()
        # the cheapest loser whose own re-try is due and affordable now (a dear one waits longer, without holding up
        # a cheap one); of equal costs the smaller K (a presumed arm costs what a smaller K measured)
        due = sorted((key for key in losers if b.retries[key].due),
                     key=lambda key: (b.cost(key), self._measure_order.index(key)))
        arm = next((key for key in due if b.retries[key].since >= self._affordable_after(b, key, winner)), None)
        if arm is not None:
            b.retry_arm, b.retry_from = arm, winner
            b.retry_left, b.retry_burst = 1, False

    def _affordable_after(self, b: _Bucket, arm: int, winner: int) -> int:
        """Steps of the winner after which a re-try of `arm` costs at most `explore_overhead` of them: its expected
        extra cost (its steps -- a burst if it never ran -- times how much dearer it is per token, plus, for a
        speculative arm re-tried while plain decoding wins, the draft's catch-up: the dearest the bucket has seen)
        spread over them, times the number of losers. Capped at max_explore_every (max_retry_wait for an arm that
        pays a catch-up or never ran), so that even a dear arm is re-tried. (With the interval alone, the re-tries of
        arms 1.6x dearer than plain decoding cost 5-8% at batch 16, on 64-token answers.)"""
        mine, best = b.cost(arm), b.cost(winner)
        if mine is None or best is None or mine <= best:
            return 0
        cfg = self.config
        never_ran = not b.arms[arm].samples
        steps = cfg.min_samples if never_ran else 1
        extra_steps = steps * (mine / best - 1)   # in steps of the winner
        # an arm that never ran is presumed from a measured loss of smaller K: no need to hurry it
        cap = cfg.max_retry_wait if never_ran else cfg.max_explore_every
        if arm != PLAIN and winner == PLAIN and b.catch_ups and b.winner_step_s:
            # The dearest recent catch-up, not the latest: a re-try that closely followed a sibling's caught up on
            # little, and timing the next ones by it re-tried every arm within ~120 steps of batch 16.
            extra_steps += max(b.catch_ups) / statistics.median(b.winner_step_s)
            cap = cfg.max_retry_wait
        # explore_overhead is the budget of all the losers' re-tries together
        losers = len(b.arms) - 1
        return min(int(math.ceil(extra_steps * losers / cfg.explore_overhead)), cap)

    def _note_catch_up(self, b: _Bucket) -> None:
        """Once the arm of a speculative run's first step (after plain decoding) has its own rate measured: what that
        step cost beyond the arm's rate is the draft's catch-up (over every prompt at its start, over every token
        since at a re-try). (Before the draft's start counted, the first re-try of K <= 1 came after about 140 steps
        of batch 16 on the embedded target and cost about 11 plain steps: 2% of a 512-step run.)"""
        if b.run_start is None:
            return
        key, step_s, tokens = b.run_start
        arm = b.arms[key]
        if len(arm.seconds) < self.config.min_samples:   # its first measurement, or a fresh burst, under way
            return
        b.run_start = None
        b.catch_ups.append(max(step_s - arm.median() * tokens, 0.0))

    def _presume_larger_k(self, b: _Bucket, key: int) -> None:
        """K <= key has just finished its first measurement: if it lost to plain decoding, the arms of larger K
        that have not run yet are presumed to lose by as much (the module docstring says why)."""
        # Only the first measurement reaches min_samples here: re-tries (a presumed arm's first run among them)
        # go through _retry_step.
        if key in (PLAIN, UNCAPPED) or b.arms[key].samples != self.config.min_samples:
            return
        plain, mine = b.cost(PLAIN), b.cost(key)
        if plain is None or mine < plain * (1 - self.config.margin):
            return
        for other in self._arm_keys:
            if (other == UNCAPPED or other > key) and b.arms[other].samples == 0:
                b.arms[other].presumed_ratio = mine / plain

    def _retry_step(self, b: _Bucket, step_s: float, emitted_tokens: int) -> None:
        """A re-try's step: one step joins the arm's window, unless it would win, or the arm has never run (its
        cost was presumed); then a fresh burst of min_samples steps decides, so no arm's estimate rests on one step.
        A speculative arm re-tried while plain decoding wins, whose first step costs CATCH_UP_STEP times its rate or
        more, runs one step more: that first step was the draft's catch-up, booked as the bucket's catch-up and kept
        out of the arm's window. (In the window, a re-tried arm's median became its catch-up steps' cost after a few
        re-tries, and the catch-up measured against it came out near zero.)"""
        arm = b.arms[b.retry_arm]
        cost = step_s / emitted_tokens
        # the re-try's first step (a catch-up step leaves run_start set until the step after it is measured)
        if not b.retry_burst and b.run_start is None and b.retry_arm != PLAIN and b.retry_from == PLAIN:
            b.run_start = (b.retry_arm, step_s, emitted_tokens)   # the draft catches up: noted once the rate is known
            if arm.seconds and cost > CATCH_UP_STEP * arm.median():
                return
        first_run = arm.samples == 0
        if not b.retry_burst and (first_run or cost < b.cost(b.retry_from)) and self.config.min_samples > 1:
            self._fresh_burst(b, b.retry_arm)
        arm.observe(step_s, emitted_tokens)
        self._note_catch_up(b)
        b.retry_left -= 1
        if not b.retry_left:
            self._end_retry(b)

    def _fresh_burst(self, b: _Bucket, arm: int) -> None:
        """The next min_samples steps run `arm` on a window of their own: its median then rests on them alone."""
        b.retry_arm = arm
        b.arms[arm].restart()
        b.retry_burst, b.retry_left = True, self.config.min_samples

    def _confirm_against(self, b: _Bucket, challenger: int, incumbent: int) -> None:
        """`challenger`'s fresh steps beat `incumbent`'s window: a fresh burst of the incumbent decides between them.
        The load changes under the gate (the batch's contexts grow; a wave of long prompts follows one of short
        ones), and each arm's window dates from when it last ran: compared with a window from a slower stretch, a
        dearer arm's fresh steps won, and at batch 16 the gate then ran K <= 1 for whole waves at 1.35x the cost of
        plain decoding (0.85x of it overall against a floor of 0.99x, standalone draft)."""
        b.confirming, b.retry_from = challenger, incumbent
        # (a speculative incumbent's first step after plain steps carries the draft's catch-up of those few tokens:
        # one step of the burst, which its median leaves out)
        self._fresh_burst(b, incumbent)

    def _end_retry(self, b: _Bucket) -> None:
        if b.confirming is None and self._winner(b) != b.retry_from and self.config.min_samples > 1:
            self._confirm_against(b, challenger=b.retry_arm, incumbent=b.retry_from)
            return
        challenger = b.retry_arm if b.confirming is None else b.confirming
        b.confirming = None
        winner = self._winner(b)
        if winner == b.retry_from:   # the re-tried arm lost again: re-try it half as often
            b.retries[challenger].confirm()
            return
        if winner != challenger and self.config.min_samples > 1:
            # a third arm, by a window from when it last ran: its fresh burst against the winner's decides first
            b.retries[challenger].confirm()
            self._fresh_burst(b, winner)
            return
        for backoff in b.retries.values():   # it won: every arm back to the base rate
            backoff.flip()

    def to_dict(self) -> dict:
        """Per bucket: the cap its next step runs (None: no cap), each arm's seconds per token (measured or
        presumed: the arms in `presumed` have not run yet), its steps."""
        def name(key: int) -> str:
            return "uncapped" if key == UNCAPPED else ("plain" if key == PLAIN else f"k<={key}")

        out = {}
        for size, b in sorted(self._buckets.items()):
            key = self._choose(b)
            out[str(size)] = {"cap": None if key == UNCAPPED else key, "speculate": key != PLAIN,
                              "s_per_token": {name(k): b.cost(k) for k in b.arms},
                              "presumed": [name(k) for k, arm in b.arms.items() if not arm.samples and
                                           arm.presumed_ratio is not None],
                              "steps": b.steps}
        return out
