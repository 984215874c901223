"""draftsmith.drafts.io.latest_drafts_by_kind: the newest draft of each kind, quantized copies only on request."""
from __future__ import annotations

import json
import os

from draftsmith.drafts.artifacts import Artifacts
from draftsmith.drafts.io import latest_drafts_by_kind
from draftsmith.drafts.quant import QUANT_FILE


def _draft(home, name: str, kind: str, mtime: int, quantized: bool = False):
    d = home / name
    d.mkdir(parents=True)
    (d / "draftsmith.json").write_text(json.dumps({"kind": kind, "target_fingerprint": "fp"}))
    if quantized:
        (d / QUANT_FILE).write_text("{}")
    os.utime(d, (mtime, mtime))
    return d


def test_the_newest_source_draft_wins_over_its_newer_quantized_copy(tmp_path):
    arts = Artifacts(tmp_path)
    home = arts.target_home("fp") / "drafts"
    old = _draft(home, "standalone-a", "standalone", 100)
    source = _draft(home, "standalone-b", "standalone", 200)
    variant = _draft(home, "standalone-b-int4-g64", "standalone", 300, quantized=True)
    eagle = _draft(home, "eagle-c", "eagle", 150)
    assert old != source
    assert latest_drafts_by_kind(arts, "fp") == {"standalone": source, "eagle": eagle}
    assert latest_drafts_by_kind(arts, "fp", include_quantized=True) == {"standalone": variant, "eagle": eagle}
