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
# DeepSpeed (the cluster extra) is also installed here so the 2-process ZeRO-2 test runs on CPU.
# It builds against the torch already in the venv (--no-build-isolation); an isolated build env
# would fetch a multi-GB CUDA torch. Its ops are JIT-built only when used, so the CPU install is
# quick. Failure is not fatal: the ZeRO test then skips and says why.
if [ "${DRAFTSMITH_SKIP_DEEPSPEED:-0}" != "1" ]; then
  "$VENV/bin/python" -m pip install --quiet -c "$constraints" --no-build-isolation \
      "deepspeed==0.19.8" >&2 || echo "[setup] deepspeed not installed; ZeRO tests will skip" >&2
fi
echo "$want" > "$STAMP"
