"""Acceptance drift: the monitor on scripted alpha streams, then the server over loopback with an
engine whose per-domain speculative counters are scripted (the real engine serves the requests)."""
from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from serve_eval.eval.report import Report, ResultRow, TargetInfo
from serve_eval.eval.report_files import write_report
from serve_eval.server.drift import DriftConfig, DriftEvent, DriftMonitor, DriftSettings, wilson_upper
from serve_eval.server.prom import parse_text
from serve_eval.speculative.metrics import SpecEngineStats, SpecStats
from server_helpers import make_engine, serve, tiny_checkpoint

K = 4


def feed(monitor: DriftMonitor, domain: str, alpha: float, rounds: int, rng: random.Random,
         totals: dict[str, list[int]]) -> list[DriftEvent]:
    """`rounds` speculative rounds of K draft tokens, each accepted with probability alpha."""
    fired = []
    for _ in range(rounds):
        total = totals.setdefault(domain, [0, 0])
        total[0] += K
        total[1] += sum(rng.random() < alpha for _ in range(K))
        event = monitor.observe(domain, *total)
        if event is not None:
            fired.append(event)
    return fired


def test_wilson_upper_bound_covers_the_rate():
    assert wilson_upper(0, 0, 3.0) == 1.0
    assert 0.5 < wilson_upper(50, 100, 3.0) < 0.66
    assert wilson_upper(100, 100, 3.0) == pytest.approx(1.0)


def test_noise_inside_the_interval_never_fires_and_a_drop_fires_after_the_window():
    """At the reference alpha, and just above its bar, 20k rounds fire nothing; an abrupt drop
    fires exactly one event once the window has turned over, not before."""
    config = DriftConfig(window_tokens=512, tolerance=0.1, z=3.0, patience=3)
    monitor = DriftMonitor({"chat": 0.8, "code": 0.6}, config)
    rng, totals = random.Random(0), {}
    assert feed(monitor, "chat", 0.8, 10_000, rng, totals) == []
    assert feed(monitor, "chat", 0.72, 10_000, rng, totals) == []     # below reference, above the bar 0.7
    assert feed(monitor, "code", 0.6, 5_000, rng, totals) == []
    events = feed(monitor, "chat", 0.3, 400, rng, totals)
    assert len(events) == 1 and events[0].domain == "chat" and events[0].bar == pytest.approx(0.7)
    rounds_to_fire = next(i for i in range(1, 400)
                          if feed(DriftMonitor({"chat": 0.8}, config), "chat", 0.3, i, random.Random(0), {}))
    assert config.window_tokens // K // 2 <= rounds_to_fire <= config.window_tokens // K + config.patience
    assert feed(monitor, "code", 0.6, 1_000, rng, totals) == []      # the other slice is untouched


def test_an_event_fires_again_only_after_recovery_or_a_promote():
    config = DriftConfig(window_tokens=256, tolerance=0.1, patience=2)
    monitor = DriftMonitor({"math": 0.7}, config)
    rng, totals = random.Random(1), {}
    assert len(feed(monitor, "math", 0.2, 2_000, rng, totals)) == 1    # one event, however long it stays low
    assert feed(monitor, "math", 0.7, 500, rng, totals) == []          # recovered
    assert len(feed(monitor, "math", 0.2, 500, rng, totals)) == 1      # a second fall fires again
    monitor.set_reference("math", 0.25)                                # a promote: a new draft at 0.25
    assert feed(monitor, "math", 0.2, 2_000, rng, totals) == []
    assert monitor.drift("math") == pytest.approx(0.05, abs=0.05)


class ScriptedSpecEngine:
    """The real engine, whose stats() carry scripted per-domain speculative counters: every step,
    each running request of a domain adds one round of K draft tokens accepted at that domain's alpha."""

    def __init__(self, engine, alphas: dict[str, float]) -> None:
        self._engine = engine
        self.alphas = alphas
        self.totals: dict[str, list[int]] = {}
        self._rng = random.Random(0)

    def step(self):
        outputs = self._engine.step()
        for seq in self._engine.scheduler.running:
            total = self.totals.setdefault(seq.domain, [0, 0])
            total[0] += K
            total[1] += sum(self._rng.random() < self.alphas[seq.domain] for _ in range(K))
        return outputs

    def stats(self):
        stats = self._engine.stats()
        by_domain = {d: SpecStats(num_rounds=p // K, num_proposed=p, num_accepted=a) for d, (p, a) in self.totals.items()}
        stats.spec = SpecEngineStats("eagle", SpecStats(), by_domain, {}, {})
        return stats

    def __getattr__(self, name):
        return getattr(self._engine, name)


@pytest.fixture()
def reference_report(tmp_path):
    rows = [ResultRow(domain=d, method="eagle", K=K, temperature=0.0, alpha=alpha, tau=2.0, a_k=[alpha] * K,
                      ms_per_token=5.0, tokens_per_s=200.0, speedup=1.5, predicted_speedup=None, ttft_p50=None,
                      ttft_p99=None, itl_p50=None, itl_p99=None, draft_time_share=None, target_time_share=None,
                      repetitions=1, spread=0.0)
            for d, alpha in (("chat", 0.8), ("code", 0.7))]
    return write_report(Report(TargetInfo("t", "fp"), {}, rows), tmp_path / "report", plots=False).json


def test_the_server_reports_drift_on_one_domain_within_200_requests_and_never_without(
        tmp_path_factory, reference_report):
    """2,000 requests at the eval alpha raise no event; after code's alpha drops abruptly, an event
    is written (JSON line) within 200 requests, the gauge shows it, and chat stays quiet."""
    engine = ScriptedSpecEngine(make_engine(tiny_checkpoint(tmp_path_factory)), {"chat": 0.8, "code": 0.7})
    log = reference_report.parent / "drift-events.jsonl"
    settings = DriftSettings(str(reference_report), "eagle", K, 0.0, str(log), None,
                             DriftConfig(window_tokens=256, tolerance=0.1, patience=2))
    body = {"prompt": "hello world", "max_tokens": 2, "ignore_eos": True, "temperature": 0}
    with serve(engine, drift=settings) as srv, httpx.Client(base_url=srv.base_url, timeout=60) as c:
        def one(i: int) -> int:   # 8 clients at once: the engine batches them, as in serving
            return c.post("/v1/completions", json={**body, "domain": ("chat", "code")[i % 2]}).status_code
        with ThreadPoolExecutor(8) as pool:
            assert set(pool.map(one, range(2000))) == {200}
        assert not log.exists()
        engine.alphas["code"] = 0.3
        sent = 0
        while not log.exists() and sent < 200:
            c.post("/v1/completions", json={**body, "domain": "code"})
            sent += 1
        assert log.exists(), "no drift event within 200 requests"
        event = DriftEvent.from_file(log)
        assert event.domain == "code" and event.rolling_alpha < event.bar < event.reference_alpha
        assert event.method == "eagle" and event.target
        gauges = {dict(labels)["domain"]: v for (name, labels), v in parse_text(c.get("/metrics").text).items()
                  if name == "draftsmith:spec_alpha_drift"}
        assert gauges["code"] > 0.1 and abs(gauges["chat"]) < 0.1
    assert len([json.loads(line) for line in log.read_text().splitlines()]) == 1
