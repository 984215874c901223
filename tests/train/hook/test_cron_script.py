"""scripts/cron_target_updated.sh up to the hook: it fingerprints the target with draftsmith's own code,
remembers the fingerprint on its first tick and says nothing while the target stays the same."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from draftsmith.drafts.identity import target_fingerprint
from spec_helpers import make_llama

REPO = Path(__file__).resolve().parents[3]


def tick(target: Path, registry: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TARGET_DIR": str(target), "DRAFTSMITH_REGISTRY": str(registry), "PYTHON": sys.executable}
    return subprocess.run(["bash", "scripts/cron_target_updated.sh"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


def test_first_tick_remembers_the_fingerprint_and_an_unchanged_target_is_a_silent_tick(tmp_path):
    target = make_llama(tmp_path / "target", layers=1)
    first = tick(target, tmp_path / "registry")
    assert first.returncode == 0, first.stdout + first.stderr
    fingerprint = target_fingerprint(target)
    assert f"first run: remembering target fingerprint {fingerprint}" in first.stdout
    state = list((tmp_path / "registry").glob("cron-*.last"))
    assert len(state) == 1 and state[0].read_text().strip() == fingerprint
    again = tick(target, tmp_path / "registry")
    assert again.returncode == 0 and again.stdout == ""
