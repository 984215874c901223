"""Fixtures the server tests share: the tiny random checkpoint, the in-process engine's outputs on it
(`LLM`, the reference every HTTP answer is compared against), a plain server on it and an httpx client.
Module-scoped (the client per test): built once per test module; a module needing another server
(an API key, speculation) defines its own `server` / `client`."""
from __future__ import annotations

import httpx
import pytest

from draftsmith.serve_eval.engine.llm import LLM
from server_helpers import ENGINE_KWARGS, make_engine, serve, tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def reference(ckpt):
    return LLM(str(ckpt), **ENGINE_KWARGS)


@pytest.fixture(scope="module")
def server(ckpt):
    with serve(make_engine(ckpt)) as srv:
        yield srv


@pytest.fixture()
def client(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c
