"""The evaluation report as a record: schema-versioned `Report` of `ResultRow`s, and its loader.

The harness fills `ResultRow`s with numbers computed by serve_eval.speculative.metrics; this module only
holds and validates them (no metric is computed here). Writing the files (report.json, report.md,
plots, W&B tables) is `report_files`.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
BASELINE_METHOD = "no-spec"  # the method every speed-up is measured against, in the same run


class ReportSchemaError(ValueError):
    """A report file that this version of draftsmith cannot read (wrong schema version or shape)."""


@dataclass
class ResultRow:
    """One (domain, method, K, temperature) cell of an eval run. None = not applicable (no-spec alpha)."""

    domain: str
    method: str
    K: int                              # draft tokens per round; 0 for no-spec
    temperature: float
    alpha: float | None                 # accepted / proposed draft tokens
    tau: float | None                   # tokens emitted per round, bonus included
    a_k: list[float]                    # per-position acceptance, a_k[k-1] for draft position k
    ms_per_token: float                 # decode wall time / generated tokens (mean over repetitions)
    tokens_per_s: float
    speedup: float | None               # baseline ms/token / this ms/token, same run
    predicted_speedup: float | None     # seed formula from measured alpha and cost ratio
    ttft_p50: float | None              # seconds
    ttft_p99: float | None
    itl_p50: float | None               # seconds
    itl_p99: float | None
    draft_time_share: float | None      # share of decode wall time spent proposing
    target_time_share: float | None     # share spent in target forwards (verify / decode)
    repetitions: int
    spread: float                       # std of ms/token over repetitions
    ms_per_token_samples: list[float] = field(default_factory=list)  # one per repetition (plots)
    # 95% intervals [low, high] from a paired bootstrap over prompts (serve_eval.eval.bootstrap);
    # None where the figure does not apply or too few prompts ran.
    alpha_ci: list[float] | None = None
    tau_ci: list[float] | None = None
    speedup_ci: list[float] | None = None
    num_prompts: int = 0
    # The draft's cost, measured in this run: draft ms per round (draft time / rounds) and
    # c = that / (K x no-spec ms/token of the same domain and T); its weights as held in memory.
    draft_ms_per_round: float | None = None
    cost_ratio: float | None = None
    draft_bytes: int | None = None
    # A quantized variant (serve_eval.eval.variants): its label (e.g. "int4-g64") and the method row of
    # the draft it was quantized from; None for every other row.
    quantization: str | None = None
    variant_of: str | None = None
    # Distinct 4-grams / all 4-grams of each output, mean over the cell's outputs (serve_eval.eval.rows): near 0
    # when the outputs loop, as an undertrained target's greedy answers do. None = the runner saw no token ids.
    distinct_4gram_share: float | None = None


@dataclass
class SkippedEntry:
    domain: str
    method: str
    reason: str


@dataclass
class TargetInfo:
    path: str
    fingerprint: str


@dataclass
class Report:
    target: TargetInfo
    config: dict[str, Any]
    results: list[ResultRow]
    skipped: list[SkippedEntry] = field(default_factory=list)
    recommendations: dict[str, Any] = field(default_factory=dict)  # recommend.Recommendations.to_dict()
    parity: list[dict[str, Any]] = field(default_factory=list)       # parity.ParityRow.to_dict() per row
    created: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for row in d["results"]:
            # metrics.py answers nan for "no data" (e.g. no rounds); JSON has no nan, the schema has null.
            for key in (*_OPTIONAL_FLOATS, *_DRAFT_COST_FLOATS):
                if isinstance(row[key], float) and not math.isfinite(row[key]):
                    row[key] = None
        # Key order as documented: version first, so a reader sees at once what it is looking at.
        order = ("schema_version", "target", "created", "config", "results", "skipped", "recommendations", "parity")
        return {k: d[k] for k in order}

    @classmethod
    def from_dict(cls, d: Any, source: str = "report") -> "Report":
        """Validate and build; ReportSchemaError names the source and the offending field."""
        if not isinstance(d, dict):
            raise ReportSchemaError(f"{source}: expected a JSON object, got {type(d).__name__}")
        version = d.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ReportSchemaError(
                f"{source}: schema_version is {version!r} but this draftsmith reads schema_version "
                f"{SCHEMA_VERSION}; regenerate the report with `draftsmith eval` or use the draftsmith "
                f"version that wrote it")
        for key, kind in (("target", dict), ("created", str), ("config", dict), ("results", list),
                          ("skipped", list), ("recommendations", dict)):
            if not isinstance(d.get(key), kind):
                raise ReportSchemaError(f"{source}: field '{key}' must be a {kind.__name__}")
        target = d["target"]
        for key in ("path", "fingerprint"):
            if not isinstance(target.get(key), str):
                raise ReportSchemaError(f"{source}: field 'target.{key}' must be a string")
        results = [_row_from_dict(r, f"{source}: results[{i}]") for i, r in enumerate(d["results"])]
        seen: set[tuple] = set()
        for i, r in enumerate(results):
            key = row_key(r)
            if key in seen:
                raise ReportSchemaError(f"{source}: results[{i}] repeats (domain, method, K, temperature) {key}")
            seen.add(key)
        skipped = []
        for i, s in enumerate(d["skipped"]):
            if not isinstance(s, dict) or not all(isinstance(s.get(k), str) for k in ("domain", "method", "reason")):
                raise ReportSchemaError(f"{source}: skipped[{i}] needs string fields domain, method, reason")
            skipped.append(SkippedEntry(s["domain"], s["method"], s["reason"]))
        parity = d.get("parity", [])
        if not isinstance(parity, list) or not all(isinstance(p, dict) for p in parity):
            raise ReportSchemaError(f"{source}: field 'parity' must be a list of objects")
        return cls(TargetInfo(target["path"], target["fingerprint"]), d["config"], results, skipped,
                   d["recommendations"], parity, d["created"], version)


def row_key(row: ResultRow) -> tuple[str, str, int, float]:
    """The identity of a result across reports (what `compare` matches on)."""
    return (row.domain, row.method, row.K, float(row.temperature))


_OPTIONAL_FLOATS = ("alpha", "tau", "speedup", "predicted_speedup", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99",
                    "draft_time_share", "target_time_share")
_DRAFT_COST_FLOATS = ("draft_ms_per_round", "cost_ratio")
_VARIANT_STRINGS = ("quantization", "variant_of")
_UNIT_INTERVAL = ("alpha", "draft_time_share", "target_time_share")
_INTERVALS = ("alpha_ci", "tau_ci", "speedup_ci")
_OPTIONAL_FIELDS = {"ms_per_token_samples", *_INTERVALS, "num_prompts", *_DRAFT_COST_FLOATS, "draft_bytes",
                    *_VARIANT_STRINGS, "distinct_4gram_share"}   # absent in older reports


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _row_from_dict(r: Any, where: str) -> ResultRow:
    if not isinstance(r, dict):
        raise ReportSchemaError(f"{where}: expected an object")
    names = {f.name for f in fields(ResultRow)}
    missing = sorted(n for n in names - _OPTIONAL_FIELDS if n not in r)
    if missing:
        raise ReportSchemaError(f"{where}: missing field(s) {', '.join(missing)}")
    for key in ("domain", "method"):
        if not isinstance(r[key], str) or not r[key]:
            raise ReportSchemaError(f"{where}.{key} must be a non-empty string")
    for key in ("K", "repetitions"):
        if not isinstance(r[key], int) or isinstance(r[key], bool) or r[key] < 0:
            raise ReportSchemaError(f"{where}.{key} must be an integer >= 0, got {r[key]!r}")
    for key in ("temperature", "ms_per_token", "tokens_per_s", "spread"):
        if not _is_number(r[key]) or r[key] < 0:
            raise ReportSchemaError(f"{where}.{key} must be a finite number >= 0, got {r[key]!r}")
    for key in _OPTIONAL_FLOATS:
        if r[key] is not None and (not _is_number(r[key]) or r[key] < 0):
            raise ReportSchemaError(f"{where}.{key} must be null or a finite number >= 0, got {r[key]!r}")
    for key in _DRAFT_COST_FLOATS:
        if r.get(key) is not None and (not _is_number(r[key]) or r[key] < 0):
            raise ReportSchemaError(f"{where}.{key} must be null or a finite number >= 0, got {r[key]!r}")
    bytes_ = r.get("draft_bytes")
    if bytes_ is not None and (not isinstance(bytes_, int) or isinstance(bytes_, bool) or bytes_ < 0):
        raise ReportSchemaError(f"{where}.draft_bytes must be null or an integer >= 0, got {bytes_!r}")
    for key in _VARIANT_STRINGS:
        if r.get(key) is not None and (not isinstance(r[key], str) or not r[key]):
            raise ReportSchemaError(f"{where}.{key} must be null or a non-empty string, got {r[key]!r}")
    share = r.get("distinct_4gram_share")
    if share is not None and (not _is_number(share) or not 0 <= share <= 1):
        raise ReportSchemaError(f"{where}.distinct_4gram_share must be null or in [0, 1], got {share!r}")
    for key in _UNIT_INTERVAL:
        if r[key] is not None and r[key] > 1:
            raise ReportSchemaError(f"{where}.{key} must be in [0, 1], got {r[key]!r}")
    for key in ("a_k", "ms_per_token_samples"):
        values = r.get(key, [])
        if not isinstance(values, list) or not all(_is_number(v) and v >= 0 for v in values):
            raise ReportSchemaError(f"{where}.{key} must be a list of finite numbers >= 0")
    if any(v > 1 for v in r["a_k"]):
        raise ReportSchemaError(f"{where}.a_k values must be in [0, 1]")
    for key in _INTERVALS:
        ci = r.get(key)
        if ci is not None and (not isinstance(ci, list) or len(ci) != 2 or not all(_is_number(v) for v in ci)
                               or ci[0] > ci[1]):
            raise ReportSchemaError(f"{where}.{key} must be null or [low, high] with low <= high, got {ci!r}")
    return ResultRow(**{n: r[n] for n in names if n in r})


def load_report(path: str | Path) -> Report:
    path = Path(path)
    if path.is_dir():
        path = path / "report.json"
    if not path.is_file():
        raise ReportSchemaError(f"no report at {path}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ReportSchemaError(f"{path}: not valid JSON ({e})") from e
    return Report.from_dict(data, source=str(path))
