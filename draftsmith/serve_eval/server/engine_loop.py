"""The one background thread that owns the engine.

The engine is single-threaded by design: only this thread calls `add_request`, `step`,
`abort` or `stats`. HTTP handlers (on the asyncio event loop) talk to it through a
thread-safe inbox of commands; the thread answers each request through that request's
own asyncio.Queue (filled with `loop.call_soon_threadsafe`).

Ordering guarantee: the inbox is drained in full before every `step()`, so an abort sent
while step k runs is applied before step k+1 - a disconnected client costs at most one
more step, and its blocks are freed by `engine.abort` right there.

Failure isolation: a request is refused at `add_request` (SamplingParams has already checked
every value in the dtype the kernels use it in), so no valid request can make a step fail. If a
step raises anyway (a bug), the supervisor fails the requests that were in flight with a clear
error, aborts them in the engine, checks the KV cache's integrity and carries on serving; only a
crash loop (`max_restarts` within `restart_window_s`) or a broken cache stops the thread.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from draftsmith.serve_eval.engine.sampling_params import SamplingParams
from draftsmith.serve_eval.server.metrics import ServerMetrics, read_engine_stats

log = logging.getLogger(__name__)


@dataclass
class LoopConfig:
    # Requests accepted but not yet running (inbox + engine waiting queue). Past this, 429.
    max_waiting_requests: int = 128
    retry_after_s: int = 1
    # How long the idle thread sleeps between checks when nothing arrives (it is woken early).
    idle_poll_s: float = 0.5
    # Failed steps survived within a window before the loop gives up (a crash loop is not served).
    max_restarts: int = 5
    restart_window_s: float = 60.0


class QueueFullError(Exception):
    def __init__(self, retry_after_s: int) -> None:
        super().__init__("server is at capacity; retry later")
        self.retry_after_s = retry_after_s


class ShuttingDownError(Exception):
    pass


class Aborted:
    """Pushed to a request's queue when the loop aborts it (shutdown, or the engine failed)."""

    def __init__(self, request_id: str, reason: str) -> None:
        self.request_id = request_id
        self.reason = reason


class Failed(Aborted):
    """Pushed to a request's queue when a step it was part of raised: the request ends with an
    error (the reason says what failed); the loop itself keeps serving."""


@dataclass(frozen=True)
class LoopHealth:
    alive: bool
    restarts: int              # failed steps the supervisor recovered from
    last_error: str | None     # the most recent one, as repr(exception)


@dataclass
class _Tracked:
    """Per-request bookkeeping the loop keeps for latency metrics and delivery. Each of an n > 1
    request's samples is timed and counted as finished on its own, as n separate requests were."""
    stream: "RequestStream"
    domain: str | None
    submit_time: float
    num_samples: int = 1
    last_token_time: dict[int, float] = field(default_factory=dict)   # by sample index
    finished_samples: set[int] = field(default_factory=set)
    num_output_tokens: int = 0

    @property
    def num_unfinished(self) -> int:
        return self.num_samples - len(self.finished_samples)


class RequestStream:
    """What a handler holds for one engine request: an ack future and a queue of outputs
    (RequestOutput, then possibly Aborted). Several streams may share one queue."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop,
                 queue: asyncio.Queue | None = None) -> None:
        self.request_id = request_id
        self.event_loop = loop
        self.accepted: asyncio.Future[None] = loop.create_future()
        self.queue: asyncio.Queue[Any] = asyncio.Queue() if queue is None else queue

    def _deliver(self, item: Any) -> None:
        self._call(self.queue.put_nowait, item)

    def _call(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            self.event_loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass   # the handler's event loop is closed: nobody is left to tell

    def _resolve(self, error: BaseException | None) -> None:
        def settle() -> None:
            if self.accepted.done():
                return
            if error is None:
                self.accepted.set_result(None)
            else:
                self.accepted.set_exception(error)
        self._call(settle)


class EngineLoop:
    def __init__(self, engine: Any, config: LoopConfig | None = None,
                 metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.config = config or LoopConfig()
        self.metrics = metrics
        self._cond = threading.Condition()
        self._inbox: collections.deque[tuple] = collections.deque()
        self._pending_adds = 0        # adds sitting in the inbox (guarded by _cond)
        self._engine_waiting = 0      # engine's waiting queue after the last command/step
        self._stopping = False
        self._drain_deadline: float | None = None
        self._thread: threading.Thread | None = None
        self._tracked: dict[str, _Tracked] = {}   # engine thread only
        self.step_count = 0
        # (request_id, step when the abort was asked for, step before which it was applied)
        self.abort_log: collections.deque[tuple[str, int, int]] = collections.deque(maxlen=1024)
        self.last_stats: Any = None
        self.fatal_error: BaseException | None = None
        self.restarts = 0
        self.last_error: str | None = None
        self._restart_times: collections.deque[float] = collections.deque()

    # ------------------------------------------------------------ handler side
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("engine loop already started")
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.fatal_error is None

    def health(self) -> LoopHealth:
        return LoopHealth(self.alive, self.restarts, self.last_error)

    def num_in_flight(self) -> int:
        """Engine requests added and not yet finished or aborted (a racy but safe len())."""
        return len(self._tracked)

    def num_waiting(self) -> int:
        with self._cond:
            return self._pending_adds + self._engine_waiting

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               priority: int = 0, domain: str | None = None, *, check_capacity: bool = True,
               queue: asyncio.Queue | None = None) -> RequestStream:
        """Queue one engine request (call from the event loop). Await `stream.accepted` next."""
        stream = RequestStream(request_id, asyncio.get_running_loop(), queue)
        with self._cond:
            if self._stopping or not self.alive:
                raise ShuttingDownError("server is shutting down")
            if check_capacity and self._pending_adds + self._engine_waiting >= self.config.max_waiting_requests:
                raise QueueFullError(self.config.retry_after_s)
            self._pending_adds += 1
            self._inbox.append(("add", stream, prompt_token_ids, params, priority, domain, time.perf_counter()))
            self._cond.notify()
        return stream

    def abort(self, request_id: str) -> None:
        """Ask the loop to abort (idempotent; unknown or finished ids are ignored)."""
        with self._cond:
            self._inbox.append(("abort", request_id, self.step_count))
            self._cond.notify()

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run fn(engine) on the engine thread between steps (safe engine inspection)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._thread is None or not self._thread.is_alive():
                # No loop thread: nothing else touches the engine, run inline.
                try:
                    future.set_result(fn(self.engine))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    future.set_exception(exc)
                return future
            self._inbox.append(("call", fn, future))
            self._cond.notify()
        return future

    def begin_shutdown(self, grace_s: float = 5.0) -> None:
        """Stop taking requests; in-flight ones get grace_s to finish, then are aborted (each
        stream still ends with a terminal event). Returns at once; a second call never extends
        the deadline."""
        with self._cond:
            deadline = time.monotonic() + max(grace_s, 0.0)
            self._stopping = True
            if self._drain_deadline is None or deadline < self._drain_deadline:
                self._drain_deadline = deadline
            self._cond.notify()

    def shutdown(self, grace_s: float = 5.0) -> None:
        """begin_shutdown(grace_s), then wait for the engine thread to finish."""
        self.begin_shutdown(grace_s)
        if self._thread is not None:
            self._thread.join()

    # ------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            self._refresh_stats()
            while True:
                with self._cond:
                    busy = self.engine.has_unfinished_requests()
                    if not self._inbox and not busy and not self._stopping:
                        self._cond.wait(self.config.idle_poll_s)
                    commands = list(self._inbox)
                    self._inbox.clear()
                    stopping, deadline = self._stopping, self._drain_deadline
                self._apply(commands)
                if stopping:
                    if not self.engine.has_unfinished_requests() and not self._inbox:
                        break
                    if deadline is not None and time.monotonic() >= deadline:
                        self._abort_all("shutdown")
                        break
                if self.engine.has_unfinished_requests():
                    steps_before = getattr(self.engine, "num_steps", None)
                    try:
                        outputs = self.engine.step()
                    except Exception as exc:  # noqa: BLE001 - the supervisor decides what survives
                        self._recover(exc)
                        continue
                    self.step_count += 1
                    self._dispatch(outputs)
                    self._refresh_stats()
                    if not outputs and steps_before == getattr(self.engine, "num_steps", None):
                        # Nothing schedulable right now (e.g. waiting on blocks): do not spin
                        # the GIL away from the HTTP side; wake early on a new command.
                        with self._cond:
                            if not self._inbox:
                                self._cond.wait(0.002)
        except BaseException as exc:  # noqa: BLE001 - the engine broke; fail every request loudly
            log.exception("engine loop crashed")
            self.fatal_error = exc
            self.last_error = repr(exc)
            self._abort_all(f"engine error: {exc!r}", engine_usable=False)
        finally:
            self._fail_inbox()

    def _recover(self, exc: Exception) -> None:
        """A step raised: fail its requests, abort them in the engine, keep serving if the KV cache
        is whole. Re-raises (ending the loop) on a crash loop or an engine that cannot recover."""
        log.exception("engine step failed; failing the %d in-flight requests", len(self._tracked))
        now = time.monotonic()
        self.restarts += 1
        self.last_error = repr(exc)
        self._restart_times.append(now)
        while self._restart_times and now - self._restart_times[0] > self.config.restart_window_s:
            self._restart_times.popleft()
        self._abort_all(f"engine step failed: {exc!r}", failed=True)
        self.engine.abort_all()       # anything the loop did not track (e.g. added by call())
        self.engine.check_integrity()
        if len(self._restart_times) > self.config.max_restarts:
            raise RuntimeError(f"{len(self._restart_times)} failed engine steps within "
                               f"{self.config.restart_window_s:.0f} s; last: {exc!r}") from exc
        self._refresh_stats()

    def _apply(self, commands: list[tuple]) -> None:
        for command in commands:
            kind = command[0]
            if kind == "add":
                _, stream, prompt_ids, params, priority, domain, submit_time = command
                try:
                    self.engine.add_request(stream.request_id, prompt_ids, params,
                                            priority=priority, domain=domain)
                except Exception as exc:  # noqa: BLE001 - refuses this request only
                    if not isinstance(exc, ValueError):
                        log.exception("add_request(%s) failed", stream.request_id)
                    stream._resolve(exc)
                else:
                    self._tracked[stream.request_id] = _Tracked(stream, domain, submit_time, params.n)
                    stream._resolve(None)
                    if self.metrics is not None:
                        self.metrics.prompt_tokens.inc(len(prompt_ids))
                with self._cond:
                    self._pending_adds -= 1
            elif kind == "abort":
                _, request_id, asked_at_step = command
                tracked = self._tracked.pop(request_id, None)
                if tracked is not None:
                    self.engine.abort(request_id)
                    self.abort_log.append((request_id, asked_at_step, self.step_count))
                    if self.metrics is not None:
                        for _ in range(tracked.num_unfinished):
                            self.metrics.request_finished("abort", tracked.domain)
            elif kind == "call":
                _, fn, future = command
                try:
                    future.set_result(fn(self.engine))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    future.set_exception(exc)
        if commands:
            self._refresh_stats()

    def _dispatch(self, outputs: list[Any]) -> None:
        now = time.perf_counter()
        for output in outputs:
            tracked = self._tracked.get(output.request_id)
            if tracked is None:
                continue   # aborted while the step ran; the handler is gone
            for completion in output.completions:
                self._observe(tracked, completion, now)
            if output.finished:
                del self._tracked[output.request_id]
            tracked.stream._deliver(output)

    def _observe(self, tracked: _Tracked, completion: Any, now: float) -> None:
        """Token and latency metrics of one sample's step."""
        num_new = len(completion.new_token_ids)
        last = tracked.last_token_time.get(completion.index)
        if num_new and self.metrics is not None:
            self.metrics.generation_tokens.inc(num_new)
            self.metrics.token_window.add(now, num_new)
            if last is None:
                self.metrics.ttft.observe(now - tracked.submit_time)
            else:
                # Per-token gap: a speculative step delivers several tokens at once.
                gap = (now - last) / num_new
                for _ in range(num_new):
                    self.metrics.itl.observe(gap)
        if num_new:
            tracked.last_token_time[completion.index] = now
            tracked.num_output_tokens += num_new
        if completion.finished and completion.index not in tracked.finished_samples:
            tracked.finished_samples.add(completion.index)
            if self.metrics is not None:
                self.metrics.e2e.observe(now - tracked.submit_time)
                self.metrics.request_finished(completion.finish_reason or "unknown", tracked.domain)

    def _abort_all(self, reason: str, engine_usable: bool = True, failed: bool = False) -> None:
        """End every tracked request: Aborted (shutdown, dead engine) or Failed (a failed step)."""
        for request_id, tracked in list(self._tracked.items()):
            if engine_usable:
                try:
                    self.engine.abort(request_id)
                except Exception:  # noqa: BLE001 - keep ending the others
                    log.exception("abort of %s failed", request_id)
            if self.metrics is not None:
                for _ in range(tracked.num_unfinished):
                    self.metrics.request_finished("error" if failed else "abort", tracked.domain)
            tracked.stream._deliver((Failed if failed else Aborted)(request_id, reason))
        self._tracked.clear()

    def _fail_inbox(self) -> None:
        """Nothing may wait forever: refuse whatever is still queued when the thread exits."""
        with self._cond:
            self._stopping = True
            commands = list(self._inbox)
            self._inbox.clear()
            self._pending_adds = 0
        for command in commands:
            if command[0] == "add":
                command[1]._resolve(ShuttingDownError("server is shutting down"))
            elif command[0] == "call":
                command[2].set_exception(ShuttingDownError("engine loop stopped"))

    def _refresh_stats(self) -> None:
        stats = self.engine.stats()
        self.last_stats = stats
        waiting = read_engine_stats(stats).num_waiting
        with self._cond:
            self._engine_waiting = waiting
        if self.metrics is not None:
            self.metrics.update_from_engine(stats)
