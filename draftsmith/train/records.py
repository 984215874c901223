"""Field checks for dataset records: a bad record is named by file, line and field, or skipped and counted.

A record missing a field, or with an empty one, used to vanish silently and surface much later as
"the distill split is empty". Here every record is checked as it is read: ``on_bad_record=error``
(the default) stops at the first bad one with ``<file>: missing field 'prompt' on line 7``;
``on_bad_record=skip`` drops it and the caller logs how many were dropped, and why.

Locations are 1-based: ``line N`` for JSON-lines files (read here, so blank lines do not shift the
count), ``record N`` for other sources (json arrays, parquet, csv, saved or hub datasets).
"""
from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BAD_RECORD_POLICIES = ("error", "skip")


@dataclass(frozen=True)
class BadRecord:
    location: str  # "line 7" / "record 7"
    field: str
    problem: str  # missing | empty | non-string (<type>)

    def describe(self, source: str) -> str:
        return f"{source}: {self.problem} field '{self.field}' on {self.location}"


@dataclass
class RecordCheck:
    """The records that passed, and what was skipped (policy skip only)."""

    kept: list[dict[str, Any]] = field(default_factory=list)
    skipped: Counter = field(default_factory=Counter)  # (field, problem) -> count
    first_skipped: BadRecord | None = None

    def skipped_summary(self) -> str:
        """`missing prompt x2, empty reference x1 (first: line 3)`; empty when nothing was skipped."""
        if not self.skipped:
            return ""
        reasons = ", ".join(f"{problem} {name} x{n}" for (name, problem), n in sorted(self.skipped.items()))
        return f"{reasons} (first: {self.first_skipped.location})"


def record_problem(row: Mapping[str, Any], fields: Iterable[str], location: str) -> BadRecord | None:
    """The first of `fields` that is absent (or null), not a string, or blank in `row`; None if all are fine."""
    for name in fields:
        value = row.get(name)
        if value is None:
            return BadRecord(location, name, "missing")
        if not isinstance(value, str):
            return BadRecord(location, name, f"non-string ({type(value).__name__})")
        if not value.strip():
            return BadRecord(location, name, "empty")
    return None


def check_policy(on_bad_record: str, setting: str = "data.on_bad_record") -> None:
    if on_bad_record not in BAD_RECORD_POLICIES:
        raise ValueError(f"{setting}: {on_bad_record!r} is not one of {BAD_RECORD_POLICIES}")


def check_records(
    rows: Iterable[tuple[str, Mapping[str, Any]]], fields: tuple[str, ...], source: str, on_bad_record: str,
    hint: str = "",
) -> RecordCheck:
    """Check (location, row) pairs; ValueError on the first bad one (policy error), else skip and count."""
    check_policy(on_bad_record)
    result = RecordCheck()
    for location, row in rows:
        bad = record_problem(row, fields, location)
        if bad is None:
            result.kept.append(dict(row))
        elif on_bad_record == "error":
            raise ValueError(bad.describe(source) + hint)
        else:
            result.skipped[(bad.field, bad.problem)] += 1
            result.first_skipped = result.first_skipped or bad
    return result


def read_jsonl(path: str | Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """("line N", object) per non-blank line; ValueError naming the line when one is not a JSON object."""
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}: could not be read as a dataset (line {number} is not JSON: {err})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}: line {number} is a JSON {type(row).__name__}, not a record object")
            yield f"line {number}", row
