"""Shared test set-up. Tests mirror the package layout (tests/serve_eval/server/..., tests/train/hook/...);
the helper modules at this folder's top (server_helpers, spec_helpers, stats_helpers, distill_fixtures,
distill_toy, tiny_models), the test modules other tests build on (test_executor, test_target_families,
test_spec_sampling_exact) and the scripts under test (scripts/demo_target_update.py) all import by
their bare names, one way."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

_TESTS = Path(__file__).resolve().parent
_FOLDERS = [_TESTS, *sorted(p for p in _TESTS.rglob("*") if p.is_dir() and p.name != "__pycache__"),
            _TESTS.parent / "scripts"]
for folder in _FOLDERS:
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

# The one process-wide setting of the test session (no helper module sets it as a side effect of
# being imported): tiny matmuls lose far more to intra-op thread hand-offs than they gain (10-20x
# slower on a loaded 2-core box). Tests of the thread setting itself set and restore their own.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def family_checkpoint(tmp_path_factory: Any) -> Callable[..., Path]:
    """Factory: family_checkpoint(family, seed=0, init=Init(), shape=SHAPE, tokenizer=None, **config_fields) saves
    a fresh tiny random checkpoint of that target family (tiny_models.FAMILIES: llama, llama-yarn,
    mistral[-window], qwen2[-window], qwen3[-window], qwen3_moe, qwen2_moe) in its own folder and returns the
    folder. Fresh on every call: no test sees another's writes."""
    from tiny_models import save_tiny_model

    def build(family: str = "llama", **kwargs: Any) -> Path:
        return save_tiny_model(tmp_path_factory.mktemp(family) / "target", family, **kwargs)

    return build
