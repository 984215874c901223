"""What the distill loop writes as it goes: metrics.jsonl (every rank's view reduced, written by rank 0) and the
progress-bar stand-in of the other ranks."""
from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class JsonlMetrics:
    """metrics.jsonl, one record per line, flushed at once (a killed run keeps what it logged)."""

    def __init__(self, path: Path, resume_step: int | None) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        kept: list[str] = []
        if resume_step is not None and path.exists():  # drop what the killed run logged past the checkpoint
            kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= resume_step]
        path.write_text("".join(line + "\n" for line in kept))
        self._handle = open(path, "a")

    def write(self, record: Mapping[str, Any]) -> None:
        self._handle.write(json.dumps(record) + "\n")
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()


@dataclass
class LogWindow:
    """Tokens and start time since the last train log line (its tokens_per_s)."""

    tokens: float = 0.0
    start: float = field(default_factory=time.perf_counter)


class NoBar:
    """Progress bar stand-in on non-main ranks."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass
