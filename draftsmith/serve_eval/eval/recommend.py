"""Per (domain, temperature) choice of draft method and K from measured results, as the YAML the server loads.

Rule (seed, 18.1.1 / 18.1.2), judged on the 95% intervals, not on the point figures: a candidate
(method, K) passes at one (domain, temperature) when the lower end of its speed-up interval reaches
min_speedup and the lower end of its alpha interval reaches min_alpha (the point figure stands in
where a row has no interval because it measured one prompt; a row of several prompts whose interval is
undefined, most of them having decoded nothing, is not enabled); the passing candidate with the best
lower speed-up bound wins, and speculation is off where none passes. Each temperature is decided on its
own, so a domain can speculate greedily and decode plainly when sampling.

The measured speed-up decides, so min_alpha defaults to 0: the seed's "off below alpha 0.5" is where a
typical draft stops paying, and here each candidate's own break-even alpha is measured instead
(serve_eval.speculative.metrics.break_even_alpha: a cheap draft at K=4 still pays at alpha 0.3). An
enabled choice carries it as `fallback_below_alpha`, and a server that loads the file drops a domain to
direct decoding when its live alpha falls below that bar (SpecPolicyConfig.min_alpha_by_domain).
A quantized variant of a draft (`standalone@int4-g64`, serve_eval.eval.variants) is one more candidate:
it is chosen where its speed-up lower bound beats its source's, and its choice names the proposer kind
and the draft dtype it was measured with, so the server runs it as it was measured.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from draftsmith.drafts.files import atomic_write_text
from draftsmith.serve_eval.eval.report import BASELINE_METHOD, ResultRow
from draftsmith.serve_eval.speculative.metrics import DEFAULT_DOMAIN, break_even_alpha
from draftsmith.serve_eval.speculative.policy import SEED_MIN_ALPHA

RECOMMENDATIONS_SCHEMA_VERSION = 3  # 3: choices name their proposer kind and draft dtype
READABLE_SCHEMA_VERSIONS = (2, 3)  # a v2 file reads as v3 with kind and dtype unset (the method's own)
# Reference methods the server cannot run itself (transformers' assisted generation).
NOT_SERVABLE = frozenset({"assisted"})


@dataclass
class Thresholds:
    min_alpha: float = 0.0           # an extra floor; the speed-up bound and each draft's break-even decide
    min_speedup: float = 1.0

    def __post_init__(self) -> None:
        if not 0 <= self.min_alpha <= 1:
            raise ValueError(f"thresholds.min_alpha must be in [0, 1], got {self.min_alpha}")
        if self.min_speedup <= 0:
            raise ValueError(f"thresholds.min_speedup must be > 0, got {self.min_speedup}")


@dataclass(frozen=True)
class DraftRoute:
    """What serves one draft method: its dir, the proposer kind (None: the method's name is the kind) and the
    draft's dtype (None: the target's; bf16 for a quantized draft's int kernels)."""

    path: str | None               # None: a method without a draft dir (ngram)
    kind: str | None = None
    dtype: str | None = None


@dataclass
class DomainChoice:
    speculate: bool
    method: str                      # BASELINE_METHOD when speculation is off
    K: int                           # 0 when speculation is off
    temperature: float = 0.0         # the measured temperature this choice was made at
    draft_path: str | None = None    # the draft dir of `method` (None: ngram, or speculation off)
    fallback: str = BASELINE_METHOD  # what the server runs when live alpha drops below the bar
    fallback_below_alpha: float = 0.5
    alpha: float | None = None       # measured alpha of the chosen (or best rejected) candidate
    alpha_low: float | None = None   # the lower end of its 95% interval
    speedup: float | None = None
    speedup_low: float | None = None
    reason: str = ""
    kind: str | None = None          # the proposer that runs `method` (None: `method` itself, e.g. ngram)
    draft_dtype: str | None = None   # the draft's dtype as measured (None: the target's)

    @property
    def proposer(self) -> str:
        return self.kind or self.method


@dataclass
class Recommendations:
    thresholds: Thresholds
    default: list[DomainChoice]                 # per temperature, for domains the eval never saw
    domains: dict[str, list[DomainChoice]]      # per domain, one choice per measured temperature
    target_fingerprint: str | None = None
    schema_version: int = RECOMMENDATIONS_SCHEMA_VERSION

    def choose(self, domain: str | None, temperature: float) -> DomainChoice | None:
        """What to run for a request of `domain` (None/unknown: the default) sampled at `temperature`:
        the choice made at the nearest measured temperature, greedy (0) and sampled (> 0) kept apart
        (their acceptance differs in kind). None when nothing was measured on that side."""
        choices = self.domains.get(domain, self.default) if domain is not None else self.default
        side = [c for c in choices if (c.temperature == 0) == (temperature == 0)]
        return min(side, key=lambda c: abs(c.temperature - temperature), default=None)

    def draft_paths(self) -> dict[str, str]:
        """method -> draft dir of every draft some choice speculates with."""
        return {method: route.path for method, route in self.routes().items() if route.path}

    def routes(self) -> dict[str, DraftRoute]:
        """method -> (draft dir, proposer kind, draft dtype) of every method some choice speculates with."""
        every = [c for cs in [self.default, *self.domains.values()] for c in cs]
        return {c.method: DraftRoute(c.draft_path, c.proposer, c.draft_dtype) for c in every if c.speculate}

    def fallback_bars(self) -> dict[str, float]:
        """domain -> the live alpha below which the server stops speculating there: the lowest break-even
        of the domain's speculating choices (so no temperature's paying draft is switched off by the
        other's bar); the default's under DEFAULT_DOMAIN."""
        every = {**self.domains, DEFAULT_DOMAIN: self.default}
        return {domain: min(c.fallback_below_alpha for c in choices if c.speculate)
                for domain, choices in every.items() if any(c.speculate for c in choices)}

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": self.schema_version, "target_fingerprint": self.target_fingerprint,
                "thresholds": asdict(self.thresholds), "default": [asdict(c) for c in self.default],
                "domains": {d: [asdict(c) for c in cs] for d, cs in sorted(self.domains.items())}}

    @classmethod
    def from_dict(cls, d: Any, source: str = "recommendations") -> "Recommendations":
        if not isinstance(d, dict):
            raise ValueError(f"{source}: expected a mapping")
        if d.get("schema_version") not in READABLE_SCHEMA_VERSIONS:
            raise ValueError(f"{source}: schema_version is {d.get('schema_version')!r}, this draftsmith reads "
                             f"{list(READABLE_SCHEMA_VERSIONS)}")
        try:
            thresholds = Thresholds(**d["thresholds"])
            default = _choices(d["default"], f"{source}: default")
            domains = {name: _choices(cs, f"{source}: domains.{name}") for name, cs in (d.get("domains") or {}).items()}
        except (KeyError, TypeError) as e:
            raise ValueError(f"{source}: malformed ({e})") from e
        return cls(thresholds, default, domains, d.get("target_fingerprint"))


def _choices(cs: Any, where: str) -> list[DomainChoice]:
    if not isinstance(cs, list):
        raise ValueError(f"{where}: expected a list of per-temperature choices")
    return [_choice(c, f"{where}[{i}]") for i, c in enumerate(cs)]


def _choice(c: Any, where: str) -> DomainChoice:
    if not isinstance(c, dict):
        raise ValueError(f"{where}: expected a mapping")
    choice = DomainChoice(**c)
    if not isinstance(choice.K, int) or choice.K < 0 or (choice.speculate and choice.K < 1):
        raise ValueError(f"{where}.K must be an integer >= 1 when speculate is true (>= 0 otherwise), got {choice.K!r}")
    if not isinstance(choice.method, str) or not choice.method:
        raise ValueError(f"{where}.method must be a non-empty string")
    if not isinstance(choice.temperature, (int, float)) or choice.temperature < 0:
        raise ValueError(f"{where}.temperature must be a number >= 0, got {choice.temperature!r}")
    return choice


def _low(value: float, ci: list[float] | None) -> float:
    return value if ci is None else ci[0]


@dataclass
class _Candidate:
    row: ResultRow                   # one (domain, temperature, method, K) cell

    @property
    def alpha_low(self) -> float:
        return _low(self.row.alpha, self.row.alpha_ci)

    @property
    def speedup_low(self) -> float:
        return _low(self.row.speedup, self.row.speedup_ci)

    def failure(self, t: Thresholds) -> str | None:
        """Why this candidate may not be enabled (judged on the interval's lower ends), or None."""
        r = self.row
        if r.num_prompts >= 2 and r.alpha_ci is None:   # a bootstrap ran but most resamples had no rounds
            return f"{r.method} K={r.K}: no 95% interval (too few of its {r.num_prompts} prompts were decoded)"
        if self.alpha_low < t.min_alpha:
            return f"{r.method} K={r.K}: alpha {_described(r.alpha, r.alpha_ci)} < {t.min_alpha:g}"
        if self.speedup_low < t.min_speedup:
            return f"{r.method} K={r.K}: speed-up {_described(r.speedup, r.speedup_ci)} < {t.min_speedup:g}"
        return None

    def fallback_bar(self, t: Thresholds) -> float:
        """The live alpha below which this candidate stops paying: its break-even at the speed-up's lower
        bound (the bound that enabled it), never below min_alpha. A row without tau (one the engine did
        not count rounds for) assumes full chains of K."""
        r = self.row
        tau = r.tau if r.tau is not None else 1 + r.K * r.alpha
        return round(max(t.min_alpha, break_even_alpha(r.alpha, tau, self.speedup_low)), 3)

    def sort_key(self) -> tuple:
        # Best lower speed-up bound; ties -> higher alpha, then smaller K (less wasted draft work), then name.
        return (-self.speedup_low, -self.alpha_low, self.row.K, self.row.method)


def _described(value: float, ci: list[float] | None) -> str:
    return f"{value:.3f}" if ci is None else f"{value:.3f} (95% CI low {ci[0]:.3f})"


def _candidates(rows: list[ResultRow], exclude: frozenset[str]) -> list[_Candidate]:
    usable = [r for r in rows if r.method != BASELINE_METHOD and r.method not in exclude and r.K >= 1
              and r.alpha is not None and r.speedup is not None]
    return sorted((_Candidate(r) for r in usable), key=_Candidate.sort_key)


def _off(t: Thresholds, temperature: float, reason: str, best: _Candidate | None = None) -> DomainChoice:
    r = None if best is None else best.row
    return DomainChoice(False, BASELINE_METHOD, 0, temperature, None, BASELINE_METHOD, t.min_alpha,
                        None if r is None else r.alpha, None if best is None else best.alpha_low,
                        None if r is None else r.speedup, None if best is None else best.speedup_low, reason)


def _on(t: Thresholds, c: _Candidate, drafts: dict[str, DraftRoute], reason: str,
        bar: float | None = None) -> DomainChoice:
    """`c` enabled; it falls back below `bar` (None: its own break-even)."""
    r = c.row
    route = drafts.get(r.method, DraftRoute(None))
    bar = c.fallback_bar(t) if bar is None else bar
    return DomainChoice(True, r.method, r.K, r.temperature, route.path, BASELINE_METHOD, bar,
                        r.alpha, c.alpha_low, r.speedup, c.speedup_low, reason, route.kind, route.dtype)


def choose_for_cell(rows: list[ResultRow], temperature: float, thresholds: Thresholds,
                    drafts: dict[str, DraftRoute] | None = None,
                    exclude: frozenset[str] = NOT_SERVABLE) -> DomainChoice:
    """Best passing (method, K) among one (domain, temperature)'s rows, or speculation off with the reason."""
    candidates = _candidates(rows, exclude)
    if not candidates:
        return _off(thresholds, temperature, "no speculative method was measured")
    for c in candidates:
        if c.failure(thresholds) is None:
            return _on(thresholds, c, drafts or {}, f"best speed-up lower bound {c.speedup_low:.2f}x "
                                                    f"(measured {c.row.speedup:.2f}x)")
    best = candidates[0]
    return _off(thresholds, temperature, f"disabled: best candidate {best.failure(thresholds)}", best)


def _default_choice(results: list[ResultRow], domains: list[str], temperature: float, thresholds: Thresholds,
                    drafts: dict[str, DraftRoute], exclude: frozenset[str]) -> DomainChoice:
    """For unseen domains at one temperature: the (method, K) that passes in every measured domain with
    the best worst-case speed-up bound, so the default never slows down a domain we know about."""
    per_domain = {d: {(c.row.method, c.row.K): c for c in _candidates(
        [r for r in results if r.domain == d and r.temperature == temperature], exclude)} for d in domains}
    shared = set.intersection(*(set(c) for c in per_domain.values())) if per_domain else set()
    safe = []
    for key in shared:
        cs = [per_domain[d][key] for d in domains]
        if all(c.failure(thresholds) is None for c in cs):
            safe.append((min(c.speedup_low for c in cs), key, cs))
    if not safe:
        return _off(thresholds, temperature, "no (method, K) passes the thresholds in every measured domain")
    worst, _, cs = max(safe, key=lambda s: (s[0], -s[1][1], s[1][0]))
    weakest = min(cs, key=lambda c: c.speedup_low)
    # an unseen domain may be any of them: fall back where the least forgiving one would stop paying
    return _on(thresholds, weakest, drafts, f"passes in all {len(domains)} domains; worst-case speed-up lower "
                                            f"bound {worst:.2f}x", bar=max(c.fallback_bar(thresholds) for c in cs))


def recommend(results: list[ResultRow], thresholds: Thresholds | None = None,
              target_fingerprint: str | None = None, exclude: frozenset[str] = NOT_SERVABLE,
              drafts: dict[str, DraftRoute] | None = None) -> Recommendations:
    """One choice per (domain, measured temperature); `drafts` (method -> its route) names what to load."""
    thresholds, drafts = thresholds or Thresholds(), dict(drafts or {})
    for r in results:
        for name in ("alpha", "speedup"):
            v = getattr(r, name)
            if v is not None and not math.isfinite(v):
                raise ValueError(f"result ({r.domain}, {r.method}, K={r.K}): {name} is not finite ({v})")
    cells: dict[str, dict[float, list[ResultRow]]] = defaultdict(lambda: defaultdict(list))
    for r in results:
        cells[r.domain][float(r.temperature)].append(r)
    domains = sorted(cells)
    chosen = {d: [choose_for_cell(rows, t, thresholds, drafts, exclude) for t, rows in sorted(cells[d].items())]
              for d in domains}
    temperatures = sorted({float(r.temperature) for r in results})
    default = [_default_choice(results, domains, t, thresholds, drafts, exclude) for t in temperatures]
    return Recommendations(thresholds, default, chosen, target_fingerprint)


def to_yaml(recs: Recommendations) -> str:
    header = ("# draftsmith speculative-decoding recommendations (`draftsmith serve serve.recommendations=FILE`).\n"
              "# Per domain and measured temperature: speculate, method, K and draft dir; `fallback` runs when\n"
              "# live alpha < fallback_below_alpha (the measured break-even alpha of the choice).\n")
    return header + yaml.safe_dump(recs.to_dict(), sort_keys=False)


def write_recommendations(recs: Recommendations, path: str | Path) -> Path:
    path = Path(path)
    atomic_write_text(path, to_yaml(recs))
    return path


def load_recommendations(path: str | Path) -> Recommendations:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"recommendations: no file at {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML ({e})") from e
    return Recommendations.from_dict(data, source=str(path))


@dataclass
class PolicySnippet:
    """Settings for a server that runs one draft `method` (serve_eval.speculative.policy.SpecPolicyConfig keys)."""

    policy: dict[str, Any]          # num_speculative_tokens, k_by_domain, fallback, min_alpha(_by_domain)
    disabled_domains: list[str]     # domains where this method should not speculate at all
    default_speculate: bool         # False: unseen domains should not speculate either


def policy_for_method(results: list[ResultRow], method: str, thresholds: Thresholds | None = None) -> PolicySnippet:
    """Per-domain K for one servable method at its lowest measured temperature, by the same rule as
    `recommend` restricted to that method (the engine's single-draft policy has one K per domain)."""
    thresholds = thresholds or Thresholds()
    rows = [r for r in results if r.method == method]
    if not rows:
        raise ValueError(f"policy_for_method: no results for method {method!r}")
    coldest = min(r.temperature for r in rows)
    recs = recommend([r for r in rows if r.temperature == coldest], thresholds, exclude=frozenset())
    picked = {d: cs[0] for d, cs in recs.domains.items()}
    k_by_domain = {d: c.K for d, c in picked.items() if c.speculate}
    default = recs.default[0]
    default_k = default.K if default.speculate else min(k_by_domain.values(), default=1)
    return PolicySnippet(
        {"num_speculative_tokens": default_k, "k_by_domain": k_by_domain, "fallback": True,
         # unseen domains: the default's bar, or, with no safe default, the seed's rule of thumb
         "min_alpha": default.fallback_below_alpha if default.speculate else SEED_MIN_ALPHA,
         "min_alpha_by_domain": {d: c.fallback_below_alpha for d, c in picked.items() if c.speculate}},
        sorted(d for d, c in picked.items() if not c.speculate), default.speculate)
