"""Shared test set-up: the tests' own helper modules (server_helpers, distill_fixtures, ...) and the
scripts under test (scripts/demo_target_update.py) import by their bare names."""
from __future__ import annotations

import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parent
for folder in (_TESTS, _TESTS.parent / "scripts"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
