"""When and how far to speculate, per domain: configured K, automatic fallback, optional adaptive K.

Fallback: a domain's running alpha (accepted / proposed over its last `window_rounds` rounds, and over
every round of its last `min_steps` engine steps) is checked once at least `min_rounds` rounds from at
least `min_steps` steps were seen since speculation was (re)enabled. (At batch 32 one step fills 32
rounds, and a batch's rounds are correlated draws: one step's running alpha read 0.18 for a draft whose
alpha was 0.37, and switched it off.) Below
`min_alpha` (default 0.5, as the seed advises; `min_alpha_by_domain` overrides it per domain, as a server
loading an eval's recommendations does with each choice's measured break-even alpha) speculation is
switched off for that domain. After
`probe_after_steps` plain decode steps it is switched on again with a fresh window (a probe); each
probe that fails again doubles the wait (`probe_backoff`, capped), a probe that survives resets it.

The bar with a measured batch gate (`fallback_bar`: "auto", the default, or "cost"): once the engine has
measured the cost ratio c (draft seconds per proposed token / target seconds per round), a domain without
a bar of its own falls back only below min(min_alpha, c). A round emits 1 + K alpha tokens for at least
the work of 1 + K c target rounds, so below alpha = c speculation cannot pay at any batch size; above it,
the gate measures at each batch size whether it does. (A fixed 0.5 switched the standalone draft off at
batch 16, running alpha 0.35; at batch 1 that kind ran 1.31x at alpha 0.39.) "auto" does so only in place of the seed's default 0.5: a min_alpha that a user or a
recommendations file set stands, as it does with "fixed" or without a measured gate. The gate measures
per batch size, not per domain: in mixed traffic a domain between c and its break-even keeps
speculating if the others carry the bucket, so a cheap draft (c near 0, n-gram) is switched off only
where it accepts next to nothing.

Adaptive K: the seed formula (1 + K alpha) / (1 + K c) is monotone in K (its derivative has the
sign of alpha - c), so it only ever picks an end of the range. We instead maximize the expected
speedup under i.i.d. per-token acceptance beta (Leviathan et al.):
    E[tokens per round] / cost per round = (1 - beta^(K+1)) / ((1 - beta) (1 + K c)),
with beta estimated by maximum likelihood from chain rounds: each round is Bernoulli trials stopped
at the first rejection or after K successes, so beta_hat = accepted / (accepted + rejecting rounds).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from draftsmith.serve_eval.speculative.metrics import DEFAULT_DOMAIN, expected_speedup


SEED_MIN_ALPHA = 0.5  # the seed's "disable speculation below alpha ~0.5", where no measured bar exists
FALLBACK_BARS = ("auto", "cost", "fixed")


@dataclass
class SpecPolicyConfig:
    num_speculative_tokens: int = 4  # K for domains not in k_by_domain
    k_by_domain: dict[str, int] = field(default_factory=dict)
    fallback: bool = True
    min_alpha: float = SEED_MIN_ALPHA
    min_alpha_by_domain: dict[str, float] = field(default_factory=dict)
    fallback_bar: str = "auto"  # "cost": min(min_alpha, measured c); "fixed": min_alpha; "auto": see the module docstring
    window_rounds: int = 32  # running alpha is measured over this many recent rounds
    min_rounds: int = 32  # rounds since (re)enabling before fallback may switch a domain off
    min_steps: int = 4  # ... and engine steps they came from (observe_round's `step`)
    probe_after_steps: int = 128  # plain decode steps before speculation is tried again
    probe_backoff: float = 2.0  # wait multiplier after each failed probe
    max_probe_after_steps: int = 4096
    adaptive_k: bool = False
    k_min: int = 1
    k_max: int = 8
    cost_ratio: float | None = None  # c = draft step cost / target step cost; None until measured
    cost_ratio_window: int = 16  # c is the median of this many latest measurements (see observe_cost_ratio)

    def __post_init__(self) -> None:
        if self.num_speculative_tokens <= 0:
            raise ValueError(f"num_speculative_tokens (K) must be > 0, got {self.num_speculative_tokens}")
        for domain, k in self.k_by_domain.items():
            if k <= 0:
                raise ValueError(f"k_by_domain[{domain!r}] (K) must be > 0, got {k}")
        if not 0 <= self.min_alpha <= 1:
            raise ValueError(f"min_alpha must be in [0, 1], got {self.min_alpha}")
        if self.fallback_bar not in FALLBACK_BARS:
            raise ValueError(f"fallback_bar must be one of {FALLBACK_BARS}, got {self.fallback_bar!r}")
        for domain, bar in self.min_alpha_by_domain.items():
            if not 0 <= bar <= 1:
                raise ValueError(f"min_alpha_by_domain[{domain!r}] must be in [0, 1], got {bar}")
        for name in ("window_rounds", "min_rounds", "min_steps", "probe_after_steps", "k_min", "cost_ratio_window"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.k_max < self.k_min:
            raise ValueError(f"k_max ({self.k_max}) must be >= k_min ({self.k_min})")
        if self.probe_backoff < 1 or self.max_probe_after_steps < self.probe_after_steps:
            raise ValueError(
                f"probe_backoff ({self.probe_backoff}) must be >= 1 and max_probe_after_steps "
                f"({self.max_probe_after_steps}) >= probe_after_steps ({self.probe_after_steps})"
            )
        if self.cost_ratio is not None and self.cost_ratio < 0:
            raise ValueError(f"cost_ratio must be >= 0, got {self.cost_ratio}")


def best_k(beta: float, cost_ratio: float, k_min: int, k_max: int) -> int:
    """K in [k_min, k_max] maximizing expected_speedup (smallest K on ties)."""
    return max(range(k_min, k_max + 1), key=lambda k: (expected_speedup(k, beta, cost_ratio), -k))


@dataclass
class _DomainState:
    enabled: bool = True
    window: deque = field(default_factory=deque)  # (proposed, accepted, engine step or None) of recent rounds
    rounds_since_enable: int = 0
    steps_since_enable: int = 0
    last_step: int | None = None
    steps_off: int = 0
    probe_wait: int = 0  # current wait before the next probe (grows on failed probes)
    probing: bool = False


class SpecPolicy:
    def __init__(self, config: SpecPolicyConfig | None = None, measured_gate: bool = False) -> None:
        """measured_gate: a batch gate measures whether speculation pays (fallback_bar "auto" -> "cost")."""
        self.config = config or SpecPolicyConfig()
        self.cost_ratio = self.config.cost_ratio
        self._cost_ratios: deque[float] = deque(maxlen=self.config.cost_ratio_window)   # measured, latest last
        bar = self.config.fallback_bar
        self.cost_bar = bar == "cost" or (bar == "auto" and measured_gate and self.config.min_alpha == SEED_MIN_ALPHA)
        self._domains: dict[str, _DomainState] = {}

    def _state(self, domain: str | None) -> _DomainState:
        key = domain or DEFAULT_DOMAIN
        if key not in self._domains:
            self._domains[key] = _DomainState(probe_wait=self.config.probe_after_steps)
        return self._domains[key]

    def configured_k(self, domain: str | None) -> int:
        return self.config.k_by_domain.get(domain or DEFAULT_DOMAIN, self.config.num_speculative_tokens)

    def min_alpha(self, domain: str | None) -> float:
        """The live alpha below which this domain falls back to direct decoding."""
        own = self.config.min_alpha_by_domain.get(domain or DEFAULT_DOMAIN)
        if own is not None:
            return own
        if self.cost_bar and self.cost_ratio is not None:
            return min(self.config.min_alpha, self.cost_ratio)
        return self.config.min_alpha

    def is_enabled(self, domain: str | None) -> bool:
        return self._state(domain).enabled

    def running_alpha(self, domain: str | None) -> float:
        window = self._state(domain).window
        proposed = sum(p for p, _, _ in window)
        return sum(a for _, a, _ in window) / proposed if proposed else math.nan

    def estimated_beta(self, domain: str | None) -> float:
        """MLE of the per-token acceptance probability from the window (chain rounds)."""
        window = self._state(domain).window
        accepted = sum(a for _, a, _ in window)
        rejecting_rounds = sum(1 for p, a, _ in window if a < p)
        return accepted / (accepted + rejecting_rounds) if accepted + rejecting_rounds else math.nan

    def num_speculative_tokens(self, domain: str | None) -> int:
        """K for this domain's next step; 0 means decode without speculation."""
        state = self._state(domain)
        if not state.enabled:
            return 0
        k = self.configured_k(domain)
        if self.config.adaptive_k and self.cost_ratio is not None and len(state.window) >= self.config.min_rounds:
            beta = self.estimated_beta(domain)
            if not math.isnan(beta):
                k = best_k(beta, self.cost_ratio, self.config.k_min, self.config.k_max)
        return k

    def observe_round(self, domain: str | None, num_proposed: int, num_accepted: int, step: int | None = None) -> None:
        """One round of this domain; `step`: the engine step it ran in (None: a step of its own)."""
        if not 0 <= num_accepted <= num_proposed:
            raise ValueError(f"round needs 0 <= num_accepted ({num_accepted}) <= num_proposed ({num_proposed})")
        state = self._state(domain)
        if step is None or step != state.last_step:
            state.steps_since_enable += 1
            state.last_step = step
        state.window.append((num_proposed, num_accepted, step))
        while len(state.window) > self.config.window_rounds and not self._recent(state, state.window[0][2]):
            state.window.popleft()
        state.rounds_since_enable += 1
        if (not self.config.fallback or state.rounds_since_enable < self.config.min_rounds
                or state.steps_since_enable < self.config.min_steps):
            return
        alpha = self.running_alpha(domain)
        if alpha < self.min_alpha(domain):
            if state.probing:  # the probe failed: wait longer next time
                state.probe_wait = min(
                    int(state.probe_wait * self.config.probe_backoff), self.config.max_probe_after_steps
                )
            state.enabled, state.steps_off, state.probing = False, 0, False
        elif state.probing:  # the probe survived a full check: back to the base wait
            state.probing, state.probe_wait = False, self.config.probe_after_steps

    def _recent(self, state: _DomainState, step: int | None) -> bool:
        """Whether a window round ran in one of the domain's last min_steps engine steps (kept past window_rounds)."""
        return step is not None and state.last_step is not None and state.last_step - step < self.config.min_steps

    def observe_non_spec_step(self, domain: str | None) -> None:
        """One engine step decoded this domain's sequences without speculation (once per step, whatever the batch)."""
        state = self._state(domain)
        if state.enabled:
            return
        state.steps_off += 1
        if state.steps_off >= state.probe_wait:
            state.enabled, state.probing = True, True
            state.window.clear()
            state.rounds_since_enable = state.steps_since_enable = 0
            state.last_step = None

    def observe_cost_ratio(self, cost_ratio: float) -> None:
        """One step's measured c (draft time per proposed token / target time per round); c is the median of the
        latest cost_ratio_window (a measured c replaces a configured one). The strategy leaves out the first step after
        plain decoding, which carries the draft's catch-up over every token since, and the median keeps out the
        spikes of a shared CPU. (At batch 16 on the embedded target such a first step's c was about 3.5 against 0.13
        for the rounds after it, and an EMA seeded by it held the fallback bar at min_alpha for ~25 steps, long enough
        to switch off an EAGLE draft whose K <= 2 the batch gate had measured 1.3x faster than plain decoding.)"""
        if cost_ratio < 0 or math.isnan(cost_ratio):
            raise ValueError(f"cost_ratio must be >= 0, got {cost_ratio}")
        self._cost_ratios.append(cost_ratio)
        self.cost_ratio = statistics.median(self._cost_ratios)

    def to_dict(self) -> dict:
        return {
            domain: {
                "enabled": state.enabled,
                "k": self.num_speculative_tokens(domain),
                "running_alpha": self.running_alpha(domain),
                "probe_wait": state.probe_wait,
                "min_alpha": self.min_alpha(domain),
            }
            for domain, state in sorted(self._domains.items())
        }
