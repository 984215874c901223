"""A small Prometheus text-exposition registry: counters, gauges and histograms with labels.

Written here rather than pulling in prometheus_client: the server needs four metric kinds,
one process, and one text format (version 0.0.4), and counters whose totals come from the
engine (cumulative values it already keeps) rather than only from local increments.

Thread-safety: every metric guards its values with one lock, so the engine thread may
observe while an HTTP handler renders.
"""
from __future__ import annotations

import math
import re
import threading
from collections.abc import Iterable, Sequence

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_NAME_RE = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")

LabelValues = tuple[str, ...]


def _escape_label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _format_value(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def _format_labels(names: Sequence[str], values: Sequence[str]) -> str:
    if not names:
        return ""
    body = ",".join(f'{n}="{_escape_label_value(v)}"' for n, v in zip(names, values))
    return "{" + body + "}"


class _Metric:
    kind = ""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> None:
        if not _NAME_RE.match(name):
            raise ValueError(f"metric name {name!r} is not a valid Prometheus name")
        for label in labelnames:
            if not _LABEL_RE.match(label) or label == "le":
                raise ValueError(f"label name {label!r} is not valid for metric {name!r}")
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._lock = threading.Lock()

    def _key(self, labels: dict[str, object]) -> LabelValues:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"metric {self.name!r} takes labels {self.labelnames}, got {sorted(labels)}")
        return tuple(str(labels[n]) for n in self.labelnames)

    def _header(self) -> list[str]:
        doc = self.documentation.replace("\\", "\\\\").replace("\n", "\\n")
        return [f"# HELP {self.name} {doc}", f"# TYPE {self.name} {self.kind}"]

    def render(self) -> list[str]:
        raise NotImplementedError


class _ScalarMetric(_Metric):
    """One float per label set, rendered as `<name><sample_suffix>{labels} value` lines."""

    sample_suffix = ""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, documentation, labelnames)
        self._values: dict[LabelValues, float] = {}

    def value(self, **labels: object) -> float:
        with self._lock:
            return self._values.get(self._key(labels), 0.0)

    def render(self) -> list[str]:
        lines = self._header()
        with self._lock:
            items = sorted(self._values.items())
        if not items and not self.labelnames:
            items = [((), 0.0)]
        sample = self.name + self.sample_suffix
        for key, value in items:
            lines.append(f"{sample}{_format_labels(self.labelnames, key)} {_format_value(value)}")
        return lines


class Counter(_ScalarMetric):
    """Monotone total. Exposed as `<name>_total` (the OpenMetrics convention vLLM follows)."""

    kind = "counter"
    sample_suffix = "_total"

    def inc(self, amount: float = 1.0, **labels: object) -> None:
        if amount < 0:
            raise ValueError(f"counter {self.name!r} cannot decrease (inc by {amount})")
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def set_total(self, total: float, **labels: object) -> None:
        """Mirror a cumulative total kept elsewhere (the engine's own counters)."""
        key = self._key(labels)
        with self._lock:
            self._values[key] = float(total)


class Gauge(_ScalarMetric):
    kind = "gauge"

    def set(self, value: float, **labels: object) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = float(value)


class Histogram(_Metric):
    """Cumulative-bucket histogram: `_bucket{le=..}`, `_sum`, `_count` per label set."""

    kind = "histogram"

    def __init__(self, name: str, documentation: str, buckets: Iterable[float],
                 labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, documentation, labelnames)
        bounds = sorted(float(b) for b in buckets)
        if not bounds or bounds != sorted(set(bounds)):
            raise ValueError(f"histogram {name!r} needs distinct bucket bounds, got {bounds}")
        if not math.isinf(bounds[-1]):
            bounds.append(math.inf)
        self.bounds = tuple(bounds)
        # Per label set: [per-bucket (non-cumulative) counts..., sum]
        self._values: dict[LabelValues, list[float]] = {}

    def observe(self, value: float, **labels: object) -> None:
        key = self._key(labels)
        index = next(i for i, b in enumerate(self.bounds) if value <= b)
        with self._lock:
            row = self._values.setdefault(key, [0.0] * (len(self.bounds) + 1))
            row[index] += 1
            row[-1] += value

    def count(self, **labels: object) -> int:
        with self._lock:
            row = self._values.get(self._key(labels))
            return 0 if row is None else int(sum(row[:-1]))

    def render(self) -> list[str]:
        lines = self._header()
        with self._lock:
            items = sorted((k, list(v)) for k, v in self._values.items())
        if not items and not self.labelnames:
            items = [((), [0.0] * (len(self.bounds) + 1))]
        for key, row in items:
            cumulative = 0.0
            for bound, n in zip(self.bounds, row[:-1]):
                cumulative += n
                le = "+Inf" if math.isinf(bound) else _format_value(bound)
                labels = _format_labels(self.labelnames + ("le",), key + (le,))
                lines.append(f"{self.name}_bucket{labels} {_format_value(cumulative)}")
            base = _format_labels(self.labelnames, key)
            lines.append(f"{self.name}_sum{base} {_format_value(row[-1])}")
            lines.append(f"{self.name}_count{base} {_format_value(cumulative)}")
        return lines


class Registry:
    def __init__(self) -> None:
        self._metrics: dict[str, _Metric] = {}

    def register(self, metric: _Metric) -> _Metric:
        if metric.name in self._metrics:
            raise ValueError(f"metric {metric.name!r} registered twice")
        self._metrics[metric.name] = metric
        return metric

    def counter(self, name: str, doc: str, labelnames: Sequence[str] = ()) -> Counter:
        return self.register(Counter(name, doc, labelnames))  # type: ignore[return-value]

    def gauge(self, name: str, doc: str, labelnames: Sequence[str] = ()) -> Gauge:
        return self.register(Gauge(name, doc, labelnames))  # type: ignore[return-value]

    def histogram(self, name: str, doc: str, buckets: Iterable[float],
                  labelnames: Sequence[str] = ()) -> Histogram:
        return self.register(Histogram(name, doc, buckets, labelnames))  # type: ignore[return-value]

    def render(self) -> str:
        lines: list[str] = []
        for metric in self._metrics.values():
            lines.extend(metric.render())
        return "\n".join(lines) + "\n"


def parse_text(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Parse exposition text back into {(sample name, sorted labels): value} (tests, load test)."""
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    sample_re = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$')
    label_re = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
    for line in text.split("\n"):   # only \n ends a line; other breaks may sit in label values
        if not line or line.startswith("#"):
            continue
        match = sample_re.match(line)
        if match is None:
            raise ValueError(f"unparseable exposition line: {line!r}")
        name, _, label_body, raw = match.groups()
        labels = tuple(sorted(label_re.findall(label_body or "")))
        samples[(name, labels)] = float(raw.replace("+Inf", "inf").replace("-Inf", "-inf"))
    return samples
