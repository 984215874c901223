"""The retrain hook's decisions, as pure functions over per-domain acceptance rates.

Nothing here reads files, trains or evaluates: the hook's steps gather the numbers and acts on what
these functions answer, so every rule below is tested on scripted values.

Alphas are fractions in [0, 1]; "5 points" of alpha is 0.05.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

# Float slack for comparing alphas: 0.75 - 0.70 is 0.05000000000000004 in binary floating point,
# and a drop of exactly the threshold must not count as a regression.
_EPS = 1e-9

EXIT_OK = 0          # nothing needed, or every retrained draft was promoted
EXIT_ERROR = 2       # bad input, incompatible target without from-scratch retraining, a failed step
EXIT_NOT_PROMOTED = 3  # retrained, but a candidate did not beat the old draft

SCOPES = ("regressed", "all")


class HookError(ValueError):
    """Bad input or a state the hook cannot act on; the message says which."""


@dataclass(frozen=True)
class HookPolicy:
    regression_threshold: float = 0.05  # a domain regressed when alpha fell by more than this
    promote_tolerance: float = 0.01     # a candidate may trail the old draft by at most this per domain
    scope: str = "regressed"            # regenerate data for: regressed domains (+ replay) | all domains
    replay_share: float = 0.2           # share of the other domains' prompts kept in the new data (scope=regressed)
    from_scratch_on_vocab_change: bool = False  # a new tokenizer/vocab: retrain from scratch, or stop
    # Recovery: re-distill in rounds (each warm-started from the last) until the candidate is back at the
    # old pair's alpha within recovery_tolerance on every regressed domain, or has won back recovery_share
    # of the alpha the update took over them (sum of gains / sum of losses: a domain the update made
    # harder to predict may never return to its old alpha), stops gaining (plateau_gain in mean alpha over
    # a round), or max_rounds is spent.
    max_rounds: int = 3
    recovery_tolerance: float = 0.02
    recovery_share: float = 0.9
    plateau_gain: float = 0.01

    def __post_init__(self) -> None:
        if not isinstance(self.max_rounds, int) or self.max_rounds < 1:
            raise ValueError(f"hook.max_rounds must be an int >= 1, got {self.max_rounds!r}")
        for name in ("regression_threshold", "promote_tolerance", "replay_share", "recovery_tolerance",
                     "recovery_share", "plateau_gain"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"hook.{name} must be in [0, 1] (alpha is a fraction: 5 points = 0.05), got {value}")
        if self.scope not in SCOPES:
            raise ValueError(f"hook.scope must be one of {SCOPES}, got {self.scope!r}")


# ----------------------------------------------------------------------------- reading alphas

class _Row(Protocol):
    domain: str
    method: str
    K: int
    temperature: float
    alpha: float | None


def operating_points(rows: Iterable[_Row], method: str) -> set[tuple[int, float]]:
    """The (K, temperature) points at which ``method`` has an alpha."""
    return {(r.K, float(r.temperature)) for r in rows if r.method == method and r.alpha is not None}


def domain_alphas(rows: Iterable[_Row], method: str,
                  points: set[tuple[int, float]] | None = None) -> dict[str, float]:
    """Mean alpha of ``method`` per domain, over its rows at ``points`` (all points when None).

    Two reports are compared at the points both measured, so a quick one-point eval of the new target
    is set against the same point of the old draft's fuller report.
    """
    sums: dict[str, list[float]] = {}
    for r in rows:
        if r.method != method or r.alpha is None:
            continue
        if points is not None and (r.K, float(r.temperature)) not in points:
            continue
        sums.setdefault(r.domain, []).append(float(r.alpha))
    return {d: sum(v) / len(v) for d, v in sorted(sums.items())}


# ----------------------------------------------------------------------------- decisions

@dataclass(frozen=True)
class DomainChange:
    before: float | None   # the reference (old draft, old target)
    after: float | None    # now (old draft, new target)

    @property
    def drop(self) -> float | None:
        return None if self.before is None or self.after is None else self.before - self.after


def compare_domains(reference: Mapping[str, float], current: Mapping[str, float],
                    domains: Iterable[str]) -> dict[str, DomainChange]:
    return {d: DomainChange(reference.get(d), current.get(d)) for d in domains}


def regressed_domains(changes: Mapping[str, DomainChange], threshold: float) -> list[str]:
    """Domains whose alpha fell by more than ``threshold``; a domain with no measurement now counts too.

    A domain without a reference (the old report never measured it) cannot regress: there is nothing
    to fall from.
    """
    out = []
    for domain, change in sorted(changes.items()):
        if change.before is None:
            continue
        if change.after is None or change.drop > threshold + _EPS:
            out.append(domain)
    return out


def data_plan(domains: Iterable[str], regressed: Iterable[str], scope: str, replay_share: float) -> dict[str, float]:
    """Share of each domain's distillation prompts to regenerate with the new target.

    scope=all: every domain in full. scope=regressed: regressed domains in full, the others at
    ``replay_share`` so the re-distilled draft does not forget them.
    """
    regressed = set(regressed)
    if scope == "all":
        return {d: 1.0 for d in sorted(domains)}
    return {d: (1.0 if d in regressed else replay_share) for d in sorted(domains)}


@dataclass(frozen=True)
class RecoveryStep:
    stop: bool
    reason: str        # target_reached | share_reached | plateau | budget | continue


def recovered_share(last: Mapping[str, float], goal: Mapping[str, float], start: Mapping[str, float | None],
                    domains: list[str]) -> float | None:
    """Share of the alpha the update took (goal - start, summed over `domains`) that `last` won back;
    None when nothing was lost."""
    lost = sum(goal[d] - (start.get(d) or 0.0) for d in domains)
    won = sum((last.get(d) or 0.0) - (start.get(d) or 0.0) for d in domains)
    return won / lost if lost > _EPS else None


def recovery_step(history: list[Mapping[str, float]], goal: Mapping[str, float | None],
                  policy: HookPolicy, start: Mapping[str, float | None] | None = None) -> RecoveryStep:
    """After round len(history): stop when every goal domain is within recovery_tolerance of its goal
    (the old draft's alpha on the old target); when, given `start` (the old draft's alpha on the new
    target), the last round won back recovery_share of what the update took; when the last round gained
    less than plateau_gain in mean alpha over the goal domains; or when max_rounds is spent."""
    if not history:
        raise ValueError("recovery_step needs at least one evaluated round")
    domains = [d for d, g in goal.items() if g is not None]
    last = history[-1]
    if all(last.get(d) is not None and last[d] >= goal[d] - policy.recovery_tolerance - _EPS for d in domains):
        return RecoveryStep(True, "target_reached")
    share = None if start is None else recovered_share(last, goal, start, domains)
    if share is not None and share >= policy.recovery_share - _EPS:
        return RecoveryStep(True, "share_reached")
    if len(history) >= policy.max_rounds:
        return RecoveryStep(True, "budget")
    if len(history) >= 2 and domains:
        mean = lambda alphas: sum(alphas.get(d) or 0.0 for d in domains) / len(domains)  # noqa: E731
        if mean(last) - mean(history[-2]) < policy.plateau_gain - _EPS:
            return RecoveryStep(True, "plateau")
    return RecoveryStep(False, "continue")


@dataclass(frozen=True)
class PromotionCheck:
    promote: bool
    reason: str
    failing: dict[str, tuple[float | None, float | None]] = field(default_factory=dict)  # domain -> (bar, candidate)


def promotion_check(bar: Mapping[str, float | None], candidate: Mapping[str, float], tolerance: float) -> PromotionCheck:
    """Promote when the candidate is at most ``tolerance`` below ``bar`` on every domain and not worse on average.

    ``bar`` is the old draft on the new target; where it has no value for a domain (it could not run)
    the caller puts what the old draft reached on the old target minus the regression threshold.
    The average clause stops a candidate that trails slightly everywhere from replacing the old one.
    """
    if not bar:
        return PromotionCheck(False, "no domain to compare on")
    failing = {d: (b, candidate.get(d)) for d, b in sorted(bar.items())
               if b is not None and (candidate.get(d) is None or candidate[d] < b - tolerance - _EPS)}
    if failing:
        return PromotionCheck(False, f"below the old draft by more than {tolerance:g} on {', '.join(failing)}", failing)
    compared = [d for d, b in bar.items() if b is not None]
    if not compared:
        return PromotionCheck(False, "the old draft has no alpha on any domain to compare against")
    mean_gain = sum(candidate[d] - bar[d] for d in compared) / len(compared)
    if mean_gain < -_EPS:
        return PromotionCheck(False, f"within tolerance per domain but worse on average ({mean_gain:+.3f})")
    return PromotionCheck(True, f"at least the old draft on every domain within {tolerance:g} "
                                f"(mean alpha gain {mean_gain:+.3f})")


def vocab_change(old: Mapping[str, Any], new: Mapping[str, Any]) -> str | None:
    """Why drafts of ``old`` cannot read ``new``'s tokens (None = same vocabulary, as far as known).

    Compares vocab_size and the tokenizer hash (drafts.identity.tokenizer_hash); a side that does not
    know a field (None) is not evidence of a change.
    """
    reasons = []
    for key, label in (("vocab_size", "vocab_size"), ("tokenizer_hash", "tokenizer vocabulary hash")):
        a, b = old.get(key), new.get(key)
        if a is not None and b is not None and a != b:
            reasons.append(f"{label} {a} -> {b}")
    return "; ".join(reasons) or None


def exit_code(errors: Iterable[str], retrained: int, promoted: int) -> int:
    """What a pipeline acts on: 2 on any error, 3 when a retrained draft was not promoted, else 0."""
    if list(errors):
        return EXIT_ERROR
    if retrained > promoted:
        return EXIT_NOT_PROMOTED
    return EXIT_OK
