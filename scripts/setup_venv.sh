#!/usr/bin/env bash
# Create .venv (if absent) and install draftsmith editable with its test extra.
# Reruns are fast: the install is skipped while pyproject.toml is unchanged (hash stamp in .venv).
# torch is pinned ==2.13.0 through a constraint, so no resolver ever swaps in another torch
# (a local CPU wheel here; on a GPU cluster pip picks the CUDA build of the same version).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-python3}"
VENV=".venv"
STAMP="$VENV/.draftsmith-install-stamp"
EXTRAS="${DRAFTSMITH_EXTRAS:-test}"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV with $($PYTHON --version 2>&1)" >&2
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip setuptools wheel >&2
fi

want="$(cat pyproject.toml | sha256sum | cut -d' ' -f1)-$EXTRAS"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && "$VENV/bin/python" -c "import importlib.metadata as m; m.version('draftsmith'); m.version('torch')" 2>/dev/null; then
  exit 0
fi

echo "[setup] installing draftsmith[$EXTRAS] into $VENV" >&2
constraints="$VENV/draftsmith-constraints.txt"
echo "torch==2.13.0" > "$constraints"
"$VENV/bin/python" -m pip install --quiet -c "$constraints" -e ".[$EXTRAS]" >&2
echo "$want" > "$STAMP"
