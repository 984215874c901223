"""draftsmith: distill speculative-decoding drafts from a target LLM and measure them in an exact serving engine.

Four rooms, importing downwards only: train -> serve_eval -> drafts -> kernels (tests/test_architecture.py).
They live under this one package so that no top-level name of ours (``kernels``, ``train``) shadows another
distribution's, such as the HF hub ``kernels`` package that transformers imports.
"""
from __future__ import annotations

import os
from pathlib import Path

# The Hydra configs (conf/ beside this package in a checkout); DRAFTSMITH_CONF points elsewhere for an
# installed copy. Every room reads its configs from here.
CONF_DIR = Path(os.environ.get("DRAFTSMITH_CONF", Path(__file__).resolve().parent.parent / "conf"))
