"""Fixtures the server tests share: the tiny random checkpoint and the in-process engine's outputs on it
(`LLM`), the reference every HTTP answer is compared against. Module-scoped: built once per test module."""
from __future__ import annotations

import pytest

from serve_eval.engine.llm import LLM
from server_helpers import ENGINE_KWARGS, tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def reference(ckpt):
    return LLM(str(ckpt), **ENGINE_KWARGS)
