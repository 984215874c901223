"""Shared set-up for the server tests: the real engine over a tiny random checkpoint, the
app on a free loopback port, and one test double (SlowEngine) for timelines the real
engine runs through too fast to observe (disconnect mid-stream, a flooded queue)."""
from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, Iterator

from draftsmith.serve_eval.engine.llm_engine import EngineConfig, LLMEngine
from draftsmith.serve_eval.server.app import ServerConfig, create_app
from draftsmith.serve_eval.server.testing import ServerThread, build_tiny_checkpoint

ENGINE_KWARGS = dict(num_gpu_blocks=96, num_cpu_blocks=16, block_size=16, max_model_len=128)


def tiny_checkpoint(tmp_path_factory: Any) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"), max_position=128)


def make_engine(model_dir: Path, **overrides: Any) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), **{**ENGINE_KWARGS, **overrides}))


class SlowEngine:
    """Test double: the real engine, with a pause before each step, so that a request stays
    in flight long enough to disconnect from it or to queue others behind it."""

    def __init__(self, engine: LLMEngine, step_delay_s: float = 0.02) -> None:
        self._engine = engine
        self._delay = step_delay_s

    def step(self):
        time.sleep(self._delay)
        return self._engine.step()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


@contextlib.contextmanager
def serve(engine: Any, **config: Any) -> Iterator[ServerThread]:
    app = create_app(engine, ServerConfig(**config))
    server = ServerThread(app, graceful_timeout_s=2.0).start()
    try:
        yield server
    finally:
        server.stop()


def engine_call(server: ServerThread, fn: Any, timeout_s: float = 30.0) -> Any:
    """Run fn(engine) on the engine thread (never touch the engine from the test thread)."""
    return server.app.state.engine_loop.call(fn).result(timeout_s)


def wait_until(predicate: Any, timeout_s: float = 30.0, what: str = "condition") -> None:
    """Poll for a state change; the timeout only guards against a hang, it asserts nothing
    about speed."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def kv_is_clean(engine: LLMEngine) -> bool:
    """check_integrity() passes and no block is held by a sequence."""
    engine.kv.check_integrity()
    return engine.stats().kv_blocks_used == 0 and not engine.has_unfinished_requests()
