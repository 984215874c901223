"""Acceptance drift in serving: per-domain rolling alpha held against the draft's recorded eval alpha.

A draft is distilled and evaluated on one picture of the traffic; when a slice of the traffic moves
(new prompts, a new target), its acceptance falls there first. The monitor keeps, per domain, the
draft tokens proposed and accepted over the last `window_tokens` proposed tokens, and calls the
slice *below its bar* when even the optimistic end of that window's interval (a Wilson upper bound
at `z`) is under the bar: noise inside the interval never counts. A slice that stays below for
`patience` consecutive observations fires one `DriftEvent`; it fires again only after it has
recovered, or after `set_reference` (a promote: a new draft, a new reference, a fresh window).

The bar of a domain is `max(min_alpha, reference - tolerance)`: the seed's advice ("alert on alpha
dropping below 0.55 for any significant traffic slice") is `min_alpha`; `tolerance` keeps a draft
that was always at 0.9 from drifting to 0.6 unnoticed.
"""
from __future__ import annotations

import collections
import json
import logging
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DriftConfig:
    window_tokens: int = 512          # proposed draft tokens the rolling alpha covers, per domain
    tolerance: float = 0.10           # alpha may fall this far below its eval reference
    min_alpha: float = 0.0            # and never below this (the seed's 0.55, if wanted)
    z: float = 3.0                    # the Wilson bound's width: noise within it never fires
    patience: int = 3                 # consecutive observations below the bar before an event

    def __post_init__(self) -> None:
        if self.window_tokens < 16:
            raise ValueError(f"drift window_tokens must be >= 16, got {self.window_tokens}")
        if not 0 <= self.tolerance < 1 or not 0 <= self.min_alpha < 1:
            raise ValueError("drift tolerance and min_alpha must be in [0, 1)")
        if self.z <= 0 or self.patience < 1:
            raise ValueError("drift z must be > 0 and patience >= 1")


@dataclass(frozen=True)
class DriftSettings:
    """How a server watches its draft: the eval report holding the reference alpha per domain, the
    report's method label and K to read, and where events go."""
    reference_report: str
    method: str
    num_speculative_tokens: int | None = None
    temperature: float | None = 0.0
    log_path: str | None = None       # JSON lines; default: beside the report, drift-events.jsonl
    webhook_url: str | None = None
    config: DriftConfig = field(default_factory=DriftConfig)

    def build(self, context: Mapping[str, str] | None = None) -> "DriftMonitor":
        references = references_from_report(self.reference_report, self.method, self.num_speculative_tokens,
                                            self.temperature)
        log_path = self.log_path or str(Path(self.reference_report).parent / "drift-events.jsonl")
        return DriftMonitor(references, self.config, event_sink(log_path, self.webhook_url),
                            {"method": self.method, **(context or {})})


@dataclass(frozen=True)
class DriftEvent:
    """What a drift event records (one JSON line): enough for `draftsmith hook drift EVENT`."""
    domain: str
    reference_alpha: float
    bar: float
    rolling_alpha: float
    upper_bound: float
    window_tokens: int
    created: str
    target: str | None = None         # the served target dir and draft dir, when the server knows them
    draft: str | None = None
    method: str | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_file(cls, path: str | Path) -> "DriftEvent":
        """The last event of a drift log (or a file holding one event)."""
        lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
        if not lines:
            raise ValueError(f"{path}: no drift event in it")
        raw = json.loads(lines[-1])
        missing = sorted({"domain", "reference_alpha", "bar", "rolling_alpha"} - raw.keys())
        if missing:
            raise ValueError(f"{path}: a drift event needs field(s) {', '.join(missing)}")
        known = cls.__dataclass_fields__
        return cls(**{k: v for k, v in raw.items() if k in known})


def wilson_upper(accepted: int, proposed: int, z: float) -> float:
    """Upper end of the Wilson score interval of accepted / proposed (1.0 with no data)."""
    if proposed <= 0:
        return 1.0
    p = accepted / proposed
    denom = 1 + z * z / proposed
    centre = p + z * z / (2 * proposed)
    half = z * math.sqrt(p * (1 - p) / proposed + z * z / (4 * proposed * proposed))
    return min(1.0, (centre + half) / denom)


@dataclass
class _Slice:
    reference: float
    window: collections.deque = field(default_factory=collections.deque)   # (proposed, accepted) deltas
    proposed: int = 0                 # sums over the window
    accepted: int = 0
    last_total: tuple[int, int] | None = None   # cumulative (proposed, accepted) at the last observation
    below: int = 0                    # consecutive observations below the bar
    fired: bool = False


class DriftMonitor:
    """Fed the engine's cumulative per-domain counters after every step (`observe`); thread-safe."""

    def __init__(self, references: Mapping[str, float], config: DriftConfig | None = None,
                 on_event: Callable[[DriftEvent], None] | None = None, context: Mapping[str, str] | None = None):
        self.config = config or DriftConfig()
        self.on_event = on_event
        self.context = dict(context or {})
        self.events: list[DriftEvent] = []
        self._lock = threading.Lock()
        self._slices = {domain: _Slice(float(alpha)) for domain, alpha in references.items()}

    def bar(self, domain: str) -> float:
        return max(self.config.min_alpha, self._slices[domain].reference - self.config.tolerance)

    def set_reference(self, domain: str, alpha: float) -> None:
        """A promote: the slice is measured afresh against the new draft's reference."""
        with self._lock:
            last = self._slices[domain].last_total if domain in self._slices else None
            self._slices[domain] = _Slice(float(alpha), last_total=last)

    def observe(self, domain: str, total_proposed: int, total_accepted: int) -> DriftEvent | None:
        """The engine's cumulative counters of one domain; returns the event it fired, if any."""
        with self._lock:
            s = self._slices.get(domain)
            if s is None:
                return None           # no reference for this domain: nothing to drift from
            before = s.last_total or (total_proposed, total_accepted)
            s.last_total = (total_proposed, total_accepted)
            delta = (total_proposed - before[0], total_accepted - before[1])
            if delta[0] <= 0:
                return None
            self._slide(s, delta)
            event = self._judge(domain, s)
        if event is not None:
            self._emit(event)
        return event

    def drift(self, domain: str) -> float | None:
        """reference - rolling alpha (positive: worse than its eval), None before any data."""
        with self._lock:
            s = self._slices.get(domain)
            if s is None or s.proposed == 0:
                return None
            return s.reference - s.accepted / s.proposed

    def domains(self) -> list[str]:
        return sorted(self._slices)

    def _slide(self, s: _Slice, delta: tuple[int, int]) -> None:
        s.window.append(delta)
        s.proposed += delta[0]
        s.accepted += delta[1]
        while s.window and s.proposed - s.window[0][0] >= self.config.window_tokens:
            old = s.window.popleft()
            s.proposed -= old[0]
            s.accepted -= old[1]

    def _judge(self, domain: str, s: _Slice) -> DriftEvent | None:
        if s.proposed < self.config.window_tokens:
            return None               # a partial window says too little
        upper = wilson_upper(s.accepted, s.proposed, self.config.z)
        bar = max(self.config.min_alpha, s.reference - self.config.tolerance)
        if upper >= bar:
            s.below, s.fired = 0, False   # recovered: a later fall fires again
            return None
        s.below += 1
        if s.fired or s.below < self.config.patience:
            return None
        s.fired = True
        return DriftEvent(domain, s.reference, bar, s.accepted / s.proposed, upper, s.proposed,
                          datetime.now(timezone.utc).isoformat(timespec="seconds"),
                          self.context.get("target"), self.context.get("draft"), self.context.get("method"))

    def _emit(self, event: DriftEvent) -> None:
        self.events.append(event)
        log.warning("draftsmith spec_alpha_drift domain=%s rolling_alpha=%.3f bar=%.3f reference=%.3f",
                    event.domain, event.rolling_alpha, event.bar, event.reference_alpha)
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception:  # noqa: BLE001 - a broken sink must not stop serving
                log.exception("drift event sink failed")


def event_sink(log_path: str | Path | None, webhook_url: str | None) -> Callable[[DriftEvent], None]:
    """Append each event as a JSON line to `log_path`, and POST it to `webhook_url` (in a thread,
    with a short timeout: a slow receiver must not hold up the engine loop)."""
    def sink(event: DriftEvent) -> None:
        if log_path is not None:
            path = Path(log_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as f:
                f.write(event.to_json() + "\n")
        if webhook_url:
            threading.Thread(target=_post, args=(webhook_url, event), daemon=True).start()
    return sink


def _post(url: str, event: DriftEvent) -> None:
    import httpx
    try:
        httpx.post(url, content=event.to_json(), headers={"Content-Type": "application/json"}, timeout=5.0)
    except httpx.HTTPError as err:
        log.warning("drift webhook %s failed: %s", url, err)


def references_from_report(report_path: str | Path, method: str, num_speculative_tokens: int | None = None,
                           temperature: float | None = None) -> dict[str, float]:
    """Per-domain eval alpha of `method` in an eval report.json (rows at the served K and temperature
    when given, else the mean over the rows of that method)."""
    from draftsmith.serve_eval.eval.report import load_report

    report = load_report(report_path)
    rows = [r for r in report.results if r.method == method and r.alpha is not None
            and (num_speculative_tokens is None or r.K == num_speculative_tokens)
            and (temperature is None or r.temperature == temperature)]
    by_domain: dict[str, list[float]] = collections.defaultdict(list)
    for row in rows:
        by_domain[row.domain].append(row.alpha)
    if not by_domain:
        raise ValueError(f"{report_path}: no alpha for method {method!r}"
                         + (f" at K={num_speculative_tokens}" if num_speculative_tokens else "")
                         + (f", T={temperature:g}" if temperature is not None else ""))
    return {domain: sum(v) / len(v) for domain, v in sorted(by_domain.items())}
