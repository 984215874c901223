#!/usr/bin/env bash
# The main command: set up .venv if needed, then run the draftsmith pipeline on the embedded default.
# Extra arguments are Hydra overrides, e.g.  scripts/run.sh pipeline=smoke   or   scripts/run.sh target.path=/ckpt
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
scripts/setup_venv.sh
# On a shared or oversubscribed CPU, spinning OpenMP workers make torch 5-10x slower; sleep instead.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
exec .venv/bin/draftsmith pipeline "$@"
