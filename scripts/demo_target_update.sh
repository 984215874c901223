#!/usr/bin/env bash
# The retrain-hook demonstration on the embedded target (README: "Retraining drafts when the target changes").
#   scripts/demo_target_update.sh            # full run, one seed (32 eval prompts x 32 tokens per domain)
#   scripts/demo_target_update.sh --seeds 3  # the benchmark: the full run for seeds 0, 1, 2 and the mean
#   scripts/demo_target_update.sh --quick    # the whole flow, bounded (a few minutes; wide intervals)
#   scripts/demo_target_update.sh --kinds eagle medusa --domain math eval.max_tokens=64
# Extra arguments go to scripts/demo_target_update.py (see its --help).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
# On a shared or oversubscribed CPU, spinning OpenMP workers make torch 5-10x slower; sleep instead.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
exec python scripts/demo_target_update.py "$@"
