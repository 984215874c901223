"""The server's Prometheus metrics: what is exposed, under which names, fed from where.

Names follow vLLM's (prefix `draftsmith:` instead of `vllm:`) so existing dashboards map
one to one; speculative counters are `..._spec_decode_num_drafts`, `..._num_draft_tokens`,
`..._num_accepted_tokens`, `..._num_accepted_tokens_per_pos{position}`, each also labelled
by `domain`. Engine-side figures (queue sizes, KV blocks, prefix hits, preemptions, spec
counters) are mirrored from `engine.stats()` after every step; latencies are observed by
the engine loop as outputs reach the server.
"""
from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field

from draftsmith.serve_eval.server.drift import DriftMonitor
from draftsmith.serve_eval.server.prom import Registry
from draftsmith.serve_eval.engine.outputs import EngineStats
from draftsmith.serve_eval.speculative.metrics import DEFAULT_DOMAIN, SpecStats   # DEFAULT_DOMAIN: requests without a domain

PREFIX = "draftsmith:"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)


@dataclass
class EngineFigures:
    """The engine stats the server exposes (zeros before the first stats, or for a test double)."""
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    kv_blocks_used: int = 0
    kv_blocks_cached: int = 0
    kv_blocks_free: int = 0
    prefix_cache_hit_rate: float = 0.0
    num_preemptions: int = 0
    spec_by_domain: dict[str, SpecStats] = field(default_factory=dict)
    rounds_by_draft: dict[tuple[str, str], int] = field(default_factory=dict)   # (domain, method), routed

    @property
    def kv_blocks_total(self) -> int:
        return self.kv_blocks_used + self.kv_blocks_cached + self.kv_blocks_free


def read_engine_stats(stats: EngineStats | None) -> EngineFigures:
    if stats is None:
        return EngineFigures()
    spec = stats.spec
    return EngineFigures(
        num_running=stats.num_running, num_waiting=stats.num_waiting, num_swapped=stats.num_swapped,
        kv_blocks_used=stats.kv_blocks_used, kv_blocks_cached=stats.kv_blocks_cached,
        kv_blocks_free=stats.kv_blocks_free, prefix_cache_hit_rate=stats.prefix_cache_hit_rate,
        num_preemptions=stats.num_preemptions,
        spec_by_domain=dict(spec.by_domain) if spec is not None else {},
        rounds_by_draft=dict(spec.rounds_by_draft) if spec is not None else {})


class TokenRateWindow:
    """Generated tokens per second over the last `window_s` seconds."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._events: collections.deque[tuple[float, int]] = collections.deque()
        self._lock = threading.Lock()

    def add(self, now: float, num_tokens: int) -> None:
        with self._lock:
            self._events.append((now, num_tokens))

    def rate(self, now: float | None = None) -> float:
        now = time.perf_counter() if now is None else now
        with self._lock:
            while self._events and self._events[0][0] < now - self.window_s:
                self._events.popleft()
            total = sum(n for _, n in self._events)
        return total / self.window_s


class ServerMetrics:
    def __init__(self, drift: DriftMonitor | None = None) -> None:
        self.drift = drift
        r = self.registry = Registry()
        p = PREFIX
        self.http_requests = r.counter(p + "http_requests", "HTTP requests by route and status.",
                                       ("route", "status"))
        self.requests_rejected = r.counter(p + "requests_rejected", "Requests refused before the engine.",
                                           ("reason",))
        self.request_success = r.counter(p + "request_success", "Engine requests finished, by reason.",
                                         ("finished_reason", "domain"))
        self.prompt_tokens = r.counter(p + "prompt_tokens", "Prompt tokens accepted into the engine.")
        self.generation_tokens = r.counter(p + "generation_tokens", "Tokens generated.")
        self.tokens_per_second = r.gauge(p + "generation_tokens_per_second",
                                         "Generated tokens per second over the last 10 s.")
        self.running = r.gauge(p + "num_requests_running", "Sequences running in the engine.")
        self.waiting = r.gauge(p + "num_requests_waiting", "Sequences waiting in the engine.")
        self.swapped = r.gauge(p + "num_requests_swapped", "Sequences swapped to CPU blocks.")
        self.kv_blocks = r.gauge(p + "kv_cache_blocks", "KV cache blocks by state.", ("state",))
        self.kv_usage = r.gauge(p + "kv_cache_usage_perc", "Fraction of KV blocks in use (0..1).")
        self.prefix_hit_rate = r.gauge(p + "prefix_cache_hit_rate", "Prefix cache hit rate (0..1).")
        self.preemptions = r.counter(p + "num_preemptions", "Cumulative preemptions.")
        self.ttft = r.histogram(p + "time_to_first_token_seconds",
                                "Time from request arrival to its first token.", _LATENCY_BUCKETS)
        self.itl = r.histogram(p + "inter_token_latency_seconds",
                               "Gap between successive tokens of a request (per token).", _ITL_BUCKETS)
        self.e2e = r.histogram(p + "e2e_request_latency_seconds",
                               "Time from request arrival to its last token.", _LATENCY_BUCKETS)
        self.spec_drafts = r.counter(p + "spec_decode_num_drafts", "Speculative rounds (drafts proposed).",
                                     ("domain",))
        self.spec_draft_tokens = r.counter(p + "spec_decode_num_draft_tokens", "Draft tokens proposed.",
                                           ("domain",))
        self.spec_accepted = r.counter(p + "spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                       ("domain",))
        self.spec_accepted_per_pos = r.counter(
            p + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0-based).", ("domain", "position"))
        self.spec_drafts_by_draft = r.counter(
            p + "spec_decode_num_drafts_by_draft", "Speculative rounds by domain and the draft that proposed "
            "them (servers holding several drafts).", ("domain", "method"))
        self.spec_alpha_drift = r.gauge(
            p + "spec_alpha_drift", "Eval alpha minus the rolling served alpha, per domain (positive: worse).",
            ("domain",))
        self.token_window = TokenRateWindow()
        self.update_from_engine(None)

    def request_finished(self, reason: str, domain: str | None) -> None:
        self.request_success.inc(finished_reason=reason, domain=domain or DEFAULT_DOMAIN)

    def update_from_engine(self, stats: EngineStats | None) -> None:
        figures = read_engine_stats(stats)
        self.running.set(figures.num_running)
        self.waiting.set(figures.num_waiting)
        self.swapped.set(figures.num_swapped)
        self.kv_blocks.set(figures.kv_blocks_used, state="used")
        self.kv_blocks.set(figures.kv_blocks_cached, state="cached")
        self.kv_blocks.set(figures.kv_blocks_free, state="free")
        total = figures.kv_blocks_total
        self.kv_usage.set(figures.kv_blocks_used / total if total else 0.0)
        self.prefix_hit_rate.set(figures.prefix_cache_hit_rate)
        self.preemptions.set_total(figures.num_preemptions)
        # Zeros rather than absence when the engine runs without speculation.
        spec = figures.spec_by_domain or {DEFAULT_DOMAIN: SpecStats()}
        for domain, counts in spec.items():
            self.spec_drafts.set_total(counts.num_rounds, domain=domain)
            self.spec_draft_tokens.set_total(counts.num_proposed, domain=domain)
            self.spec_accepted.set_total(counts.num_accepted, domain=domain)
            for position, accepted in enumerate(counts.accepted_by_position or [0]):
                self.spec_accepted_per_pos.set_total(accepted, domain=domain, position=position)
            if self.drift is not None:
                self.drift.observe(domain, counts.num_proposed, counts.num_accepted)
        for (domain, method), rounds in figures.rounds_by_draft.items():
            self.spec_drafts_by_draft.set_total(rounds, domain=domain, method=method)
        if self.drift is not None:
            for domain in self.drift.domains():
                gap = self.drift.drift(domain)
                self.spec_alpha_drift.set(0.0 if gap is None else gap, domain=domain)

    def render(self) -> str:
        self.tokens_per_second.set(self.token_window.rate())
        return self.registry.render()
