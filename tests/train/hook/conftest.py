"""Fixtures of the retrain hook's tests."""

from __future__ import annotations

import pytest

from hook_fakes import make_world


@pytest.fixture
def world(tmp_path):
    """Old and new target, an old draft promoted for the old target with its eval report, a registry."""
    return make_world(tmp_path)
