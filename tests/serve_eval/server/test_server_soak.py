"""Soak under forced preemption while speculating: `scripts/load_test.py` with a KV budget of 24
blocks for 16 concurrent clients, so that sequences are preempted both by recompute and by swap.
Nothing may be lost, no block may leak, and greedy outputs equal those without speculation."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_load_test_under_forced_preemption_with_speculation(tmp_path):
    out = tmp_path / "soak.json"
    done = subprocess.run(
        [sys.executable, "scripts/load_test.py", "--requests", "200", "--concurrency", "16",
         "--num-gpu-blocks", "24", "--num-cpu-blocks", "64", "--swap-threshold-tokens", "24",
         "--spec", "method=ngram,num_speculative_tokens=4", "--json-out", str(out)],
        cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False, timeout=600,
        stdout=subprocess.DEVNULL)
    plain, speculative = json.loads(out.read_text())
    for report in (plain, speculative):
        assert report["lost"] == 0, report["lost_details"]
        assert report["completed"] > 0 and report["block_pool"]["ok"], report["block_pool"]
        pool = report["block_pool"]
        # Both preemption modes happened: some by swap, the rest by recompute.
        assert 0 < pool["swap_preemptions"] < pool["preemptions"], pool
    assert speculative["spec_counters"]["num_drafts"] > 0
    equal, total = map(int, speculative["greedy_equal_to_spec_off"].split("/"))
    assert total > 0 and equal == total
    assert done.returncode == 0
