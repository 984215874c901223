"""Work in a spawned process of its own: what crosses back to the parent (log lines, W&B metrics, the result or the
error), and the one case that needs it outside the side-by-side lanes (train.pipeline.side_by_side): multi-thread
training whose OpenMP workers spin briefly between ops.

Why spin: draftsmith sets OMP_WAIT_POLICY=PASSIVE before torch loads (draftsmith/__init__), so OpenMP workers sleep
after each multi-thread op and the serving engine's one-thread steps and its native kernels' helper threads keep
their cores. A training step is the opposite case: hundreds of back-to-back small ops, each of which must first
wake the sleeping workers. On the 2-core AVX2 machine a step of the embedded target (20 x 256, 2 x 256 tokens,
fp32, 2 threads) took 0.73 s under PASSIVE and 0.50 s with the workers spinning up to GOMP_SPINCOUNT=30000 (about
0.3 ms) between ops (10000: 0.53 s; 1000: 0.58 s): 1.46x the steps in the target's time cap. libgomp reads its spin
count once, as torch loads it, so such training runs in a spawned process that loads torch with it; a
GOMP_SPINCOUNT the user set stands (it also decides over an OMP_WAIT_POLICY, which the count overrides; a torch
built on another OpenMP runtime ignores it).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

SPIN_COUNT_ENV = "GOMP_SPINCOUNT"   # libgomp: iterations a worker spins for new work before it sleeps
CHILD_LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"
log = logging.getLogger(__name__)


def parent_log_files() -> list[str]:
    """The files this process's root logger writes to (a Hydra job's run.log), for a worker to append to."""
    return [h.baseFilename for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]


def configure_child_logging(log_files: list[str], log_format: str = CHILD_LOG_FORMAT) -> None:
    """A worker's log lines go to stderr and to the parent's log files (appended: the parent writes there too)."""
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    handlers += [logging.FileHandler(path) for path in log_files]
    logging.basicConfig(level=logging.INFO, handlers=handlers, force=True, format=log_format)


def portable_error(error: BaseException) -> BaseException:
    """`error` if a queue can carry it to the parent and back into an error (its type kept, so bad input stays one
    line), else its text."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error


def log_worker_failure(error: BaseException, what: str) -> None:
    """A worker's error, before it crosses to the parent: bad input (a ValueError) is the parent's one line to
    print; anything else leaves its traceback here, where it happened (the parent re-raises it without one)."""
    if isinstance(error, ValueError):
        log.info("%s stopped on bad input (the parent reports it): %s", what, error)
    else:
        log.exception("%s failed in its worker process", what)


def exit_with_parent(poll_s: float = 1.0) -> None:
    """A daemon thread that ends this worker when its parent dies (a killed job's worker would otherwise train on,
    then replace the cache entry its parent no longer holds the lock of)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


class RelayedRun:
    """The W&B run a worker logs to: each `log` call crosses to the parent, which logs it to its own run."""

    def __init__(self, events: Any) -> None:
        self._events = events

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        self._events.put(("log", (dict(metrics), step)))


def _spun_main(fn: Callable[..., Any], kwargs: dict[str, Any], relay_run: bool, events: Any,
               log_files: list[str]) -> None:
    configure_child_logging(log_files)
    exit_with_parent()
    try:
        result = fn(**kwargs, run=RelayedRun(events) if relay_run else None)
    except BaseException as error:
        log_worker_failure(error, getattr(fn, "__qualname__", str(fn)))
        events.put(("error", portable_error(error)))
        return
    events.put(("done", result))


def run_spinning(fn: Callable[..., Any], kwargs: dict[str, Any], spin_count: int, run: Any = None,
                 name: str = "training", poll_s: float = 0.2) -> Any:
    """fn(**kwargs, run=...) in a spawned process whose OpenMP workers spin up to `spin_count` iterations between
    ops (module docstring); its `run.log` calls reach `run` as they happen. Returns what fn returns (picklable);
    raises what it raised. An interrupt here stops the worker."""
    context = multiprocessing.get_context("spawn")   # a forked worker would inherit torch, loaded passive
    events = context.Queue()
    worker = context.Process(target=_spun_main, args=(fn, kwargs, run is not None, events, parent_log_files()),
                             name=name)
    user_value = os.environ.get(SPIN_COUNT_ENV)
    if user_value is None:   # the child reads the environment as it starts
        os.environ[SPIN_COUNT_ENV] = str(spin_count)
    try:
        worker.start()
    finally:
        if user_value is None:
            del os.environ[SPIN_COUNT_ENV]
    try:
        while True:
            try:
                kind, payload = events.get(timeout=poll_s)
            except queue.Empty:
                if not worker.is_alive() and events.empty():
                    raise RuntimeError(f"{name}: its worker process died (exit code {worker.exitcode})") from None
                continue
            if kind == "log":
                run.log(payload[0], step=payload[1])
                continue
            worker.join()
            if kind == "error":
                raise payload
            return payload
    except BaseException:
        if worker.is_alive():
            worker.terminate()
            worker.join()
        raise
