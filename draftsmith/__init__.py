"""draftsmith: distill speculative-decoding drafts from a target LLM and measure them in an exact serving engine.

Four rooms, importing downwards only: train -> serve_eval -> drafts -> kernels (tests/test_architecture.py).
They live under this one package so that no top-level name of ours (``kernels``, ``train``) shadows another
distribution's, such as the HF hub ``kernels`` package that transformers imports.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

# Before torch loads OpenMP (libgomp reads this variable once, as torch is imported): with spinning workers, every
# multi-thread op leaves a worker spinning for milliseconds after it, which takes a core from the engine's
# one-thread steps and the native kernels' helpers. On the 2-core VM a batch-32 decode step that followed a
# 2-thread op took 22-24 ms against 16 (15-17 with PASSIVE); on a shared CPU torch ran 5-10x slower. Importing
# draftsmith before torch is enough (the CLI, the jobs and the scripts do); a value set by the user stands.
if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# whether torch's OpenMP workers sleep between ops (the engine warns when they spin: serve_eval.engine.threads)
OMP_PASSIVE = os.environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE"

# The Hydra configs (conf/ beside this package in a checkout); DRAFTSMITH_CONF points elsewhere for an
# installed copy. Every room reads its configs from here.
CONF_DIR = Path(os.environ.get("DRAFTSMITH_CONF", Path(__file__).resolve().parent.parent / "conf"))
