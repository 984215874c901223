"""Per-domain choice of draft method and K from measured results, as a YAML snippet the server loads.

Rule (seed, 18.1.1 / 18.1.2): pick the candidate with the best measured speed-up; disable
speculation for a domain when even that candidate has alpha < min_alpha or speed-up < min_speedup
(a candidate measured at several temperatures must pass at every one; its score is the mean).
Each enabled domain also carries its fallback: the server drops to direct decoding for that
domain when its live acceptance rate falls below `fallback_below_alpha`.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from drafts.files import atomic_write_text
from serve_eval.eval.report import BASELINE_METHOD, ResultRow

RECOMMENDATIONS_SCHEMA_VERSION = 1
# Reference methods the server cannot run itself (transformers' assisted generation).
NOT_SERVABLE = frozenset({"assisted"})


@dataclass
class Thresholds:
    min_alpha: float = 0.5
    min_speedup: float = 1.0

    def __post_init__(self) -> None:
        if not 0 <= self.min_alpha <= 1:
            raise ValueError(f"thresholds.min_alpha must be in [0, 1], got {self.min_alpha}")
        if self.min_speedup <= 0:
            raise ValueError(f"thresholds.min_speedup must be > 0, got {self.min_speedup}")


@dataclass
class DomainChoice:
    speculate: bool
    method: str                      # BASELINE_METHOD when speculation is off
    K: int                           # 0 when speculation is off
    fallback: str = BASELINE_METHOD  # what the server runs when live alpha drops below the bar
    fallback_below_alpha: float = 0.5
    alpha: float | None = None       # mean measured alpha of the chosen (or best rejected) candidate
    speedup: float | None = None     # mean measured speed-up of that candidate
    temperatures: list[float] = field(default_factory=list)
    reason: str = ""


@dataclass
class Recommendations:
    thresholds: Thresholds
    default: DomainChoice                       # for domains the eval never saw
    domains: dict[str, DomainChoice]
    target_fingerprint: str | None = None
    schema_version: int = RECOMMENDATIONS_SCHEMA_VERSION

    def for_domain(self, domain: str | None) -> DomainChoice:
        """What the server should run for a request labelled `domain` (None/unknown -> default)."""
        return self.domains.get(domain, self.default) if domain is not None else self.default

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": self.schema_version, "target_fingerprint": self.target_fingerprint,
                "thresholds": asdict(self.thresholds), "default": asdict(self.default),
                "domains": {d: asdict(c) for d, c in sorted(self.domains.items())}}

    @classmethod
    def from_dict(cls, d: Any, source: str = "recommendations") -> "Recommendations":
        if not isinstance(d, dict):
            raise ValueError(f"{source}: expected a mapping")
        if d.get("schema_version") != RECOMMENDATIONS_SCHEMA_VERSION:
            raise ValueError(f"{source}: schema_version is {d.get('schema_version')!r}, this draftsmith reads "
                             f"{RECOMMENDATIONS_SCHEMA_VERSION}")
        try:
            thresholds = Thresholds(**d["thresholds"])
            default = _choice(d["default"], f"{source}: default")
            domains = {name: _choice(c, f"{source}: domains.{name}") for name, c in (d.get("domains") or {}).items()}
        except (KeyError, TypeError) as e:
            raise ValueError(f"{source}: malformed ({e})") from e
        return cls(thresholds, default, domains, d.get("target_fingerprint"))


def _choice(c: Any, where: str) -> DomainChoice:
    if not isinstance(c, dict):
        raise ValueError(f"{where}: expected a mapping")
    choice = DomainChoice(**c)
    if not isinstance(choice.K, int) or choice.K < 0 or (choice.speculate and choice.K < 1):
        raise ValueError(f"{where}.K must be an integer >= 1 when speculate is true (>= 0 otherwise), got {choice.K!r}")
    if not isinstance(choice.method, str) or not choice.method:
        raise ValueError(f"{where}.method must be a non-empty string")
    return choice


@dataclass
class _Candidate:
    method: str
    K: int
    rows: list[ResultRow]

    @property
    def mean_speedup(self) -> float:
        return sum(r.speedup for r in self.rows) / len(self.rows)

    @property
    def mean_alpha(self) -> float:
        return sum(r.alpha for r in self.rows) / len(self.rows)

    def failure(self, t: Thresholds) -> str | None:
        """Why this candidate may not be enabled, or None if it passes at every temperature."""
        for r in sorted(self.rows, key=lambda r: r.temperature):
            if r.alpha < t.min_alpha:
                return f"{self.method} K={self.K}: alpha {r.alpha:.3f} < {t.min_alpha:g} at T={r.temperature:g}"
            if r.speedup < t.min_speedup:
                return f"{self.method} K={self.K}: speed-up {r.speedup:.3f} < {t.min_speedup:g} at T={r.temperature:g}"
        return None

    def sort_key(self) -> tuple:
        # Best mean speed-up; ties -> higher alpha, then smaller K (less wasted draft work), then name.
        return (-self.mean_speedup, -self.mean_alpha, self.K, self.method)


def _candidates(rows: list[ResultRow], exclude: frozenset[str]) -> list[_Candidate]:
    groups: dict[tuple[str, int], list[ResultRow]] = defaultdict(list)
    for r in rows:
        if r.method == BASELINE_METHOD or r.method in exclude or r.K < 1:
            continue
        if r.alpha is None or r.speedup is None:  # nothing to judge it by
            continue
        groups[(r.method, r.K)].append(r)
    return sorted((_Candidate(m, k, rs) for (m, k), rs in groups.items()), key=_Candidate.sort_key)


def _off(t: Thresholds, reason: str, best: _Candidate | None = None) -> DomainChoice:
    return DomainChoice(False, BASELINE_METHOD, 0, BASELINE_METHOD, t.min_alpha,
                        None if best is None else best.mean_alpha, None if best is None else best.mean_speedup,
                        [] if best is None else sorted({r.temperature for r in best.rows}), reason)


def _on(t: Thresholds, c: _Candidate, reason: str) -> DomainChoice:
    return DomainChoice(True, c.method, c.K, BASELINE_METHOD, t.min_alpha, c.mean_alpha, c.mean_speedup,
                        sorted({r.temperature for r in c.rows}), reason)


def choose_for_domain(rows: list[ResultRow], thresholds: Thresholds,
                      exclude: frozenset[str] = NOT_SERVABLE) -> DomainChoice:
    """Best passing (method, K) for one domain's rows, or speculation off with the reason."""
    candidates = _candidates(rows, exclude)
    if not candidates:
        return _off(thresholds, "no speculative method was measured")
    for c in candidates:
        if c.failure(thresholds) is None:
            return _on(thresholds, c, f"best measured speed-up {c.mean_speedup:.2f}x")
    best = candidates[0]
    return _off(thresholds, f"disabled: best candidate {best.failure(thresholds)}", best)


def _default_choice(results: list[ResultRow], domains: list[str], thresholds: Thresholds,
                    exclude: frozenset[str]) -> DomainChoice:
    """For unseen domains: the (method, K) that passes in every measured domain with the best worst-case
    speed-up, so the default never slows down a domain we know about; otherwise speculation off."""
    per_domain = {d: {(c.method, c.K): c for c in _candidates([r for r in results if r.domain == d], exclude)}
                  for d in domains}
    shared = set.intersection(*(set(c) for c in per_domain.values())) if per_domain else set()
    safe = []
    for key in shared:
        cs = [per_domain[d][key] for d in domains]
        if all(c.failure(thresholds) is None for c in cs):
            safe.append((min(c.mean_speedup for c in cs), key, cs))
    if not safe:
        return _off(thresholds, "no (method, K) passes the thresholds in every measured domain")
    worst, (method, K), cs = max(safe, key=lambda s: (s[0], -s[1][1], s[1][0]))
    pooled = _Candidate(method, K, [r for c in cs for r in c.rows])
    return _on(thresholds, pooled, f"passes in all {len(domains)} domains; worst-case speed-up {worst:.2f}x")


def recommend(results: list[ResultRow], thresholds: Thresholds | None = None,
              target_fingerprint: str | None = None, exclude: frozenset[str] = NOT_SERVABLE) -> Recommendations:
    thresholds = thresholds or Thresholds()
    for r in results:
        for name in ("alpha", "speedup"):
            v = getattr(r, name)
            if v is not None and not math.isfinite(v):
                raise ValueError(f"result ({r.domain}, {r.method}, K={r.K}): {name} is not finite ({v})")
    domains = sorted({r.domain for r in results})
    chosen = {d: choose_for_domain([r for r in results if r.domain == d], thresholds, exclude) for d in domains}
    default = _default_choice(results, domains, thresholds, exclude)
    return Recommendations(thresholds, default, chosen, target_fingerprint)


def to_yaml(recs: Recommendations) -> str:
    header = ("# draftsmith speculative-decoding recommendations (server config snippet).\n"
              "# Per domain: speculate, method and K; `fallback` runs when live alpha < fallback_below_alpha.\n")
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
    """Settings for a server that runs one draft `method` (serve_eval.spec.policy.SpecPolicyConfig keys)."""

    policy: dict[str, Any]          # num_speculative_tokens, k_by_domain, fallback, min_alpha
    disabled_domains: list[str]     # domains where this method should not speculate at all
    default_speculate: bool         # False: unseen domains should not speculate either


def policy_for_method(results: list[ResultRow], method: str, thresholds: Thresholds | None = None) -> PolicySnippet:
    """Per-domain K for one servable method, by the same rule as `recommend` restricted to that method."""
    thresholds = thresholds or Thresholds()
    rows = [r for r in results if r.method == method]
    if not rows:
        raise ValueError(f"policy_for_method: no results for method {method!r}")
    recs = recommend(rows, thresholds, exclude=frozenset())
    k_by_domain = {d: c.K for d, c in recs.domains.items() if c.speculate}
    default_k = recs.default.K if recs.default.speculate else min(k_by_domain.values(), default=1)
    return PolicySnippet(
        {"num_speculative_tokens": default_k, "k_by_domain": k_by_domain, "fallback": True,
         "min_alpha": thresholds.min_alpha},
        sorted(d for d, c in recs.domains.items() if not c.speculate), recs.default.speculate)
