"""Acceptance drift: the monitor on scripted alpha streams, then the server over loopback with the real
speculative engine, whose per-request counters come from verifying a draft of scripted quality."""
from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from draftsmith.serve_eval.eval.report import Report, ResultRow, TargetInfo
from draftsmith.serve_eval.eval.report_files import write_report
from draftsmith.serve_eval.server.drift import DriftConfig, DriftEvent, DriftMonitor, DriftSettings, wilson_upper
from draftsmith.serve_eval.server.prom import parse_text
from draftsmith.serve_eval.engine import SamplingParams
from draftsmith.serve_eval.speculative.proposers.base import Proposal, Proposer
from server_helpers import ENGINE_KWARGS, serve, tiny_checkpoint

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


class SwappableOracle(Proposer):
    """A draft whose quality per domain is a knob, run by the REAL speculative engine: it knows each
    prompt's greedy continuation and proposes it, each token right with probability `p_right[domain]`
    (after a miss the chain is wrong). The engine verifies, counts accepted tokens per request and
    domain, and the server's drift monitor reads those counters: only the draft is scripted.
    Lowering one domain's `p_right` is the swap to a bad draft on that slice."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], p_right: dict[str, float],
                 vocab: int) -> None:
        self.full = [list(prompt) + cont for prompt, cont in continuations.items()]
        self.p_right, self.vocab = p_right, vocab
        self.rng = random.Random(0)

    def _truth(self, tokens: list[int]) -> list[int]:
        n = len(tokens)
        return next((full[n:] for full in self.full if full[:n] == tokens), [])

    def propose(self, seqs, num_tokens, features=None):
        out = []
        for seq, k in zip(seqs, num_tokens):
            truth, ok, tokens = self._truth(list(seq.token_ids)), True, []
            for depth in range(k):
                right = truth[depth] if depth < len(truth) else self.rng.randrange(self.vocab)
                ok = ok and self.rng.random() < self.p_right[seq.domain]
                tokens.append(right if ok else (right + self.rng.randrange(1, self.vocab)) % self.vocab)
            out.append(Proposal(torch.tensor(tokens, dtype=torch.int64)))
        return out


def spec_engine(model_dir, oracle: SwappableOracle):
    from draftsmith.serve_eval.engine.llm_engine import EngineConfig, LLMEngine
    from draftsmith.serve_eval.speculative.config import SpecConfig
    from draftsmith.serve_eval.speculative.strategy import SpeculativeStrategy
    from server_helpers import ENGINE_KWARGS

    return LLMEngine(EngineConfig(str(model_dir), **ENGINE_KWARGS),
                     strategy=SpeculativeStrategy(SpecConfig("ngram", num_speculative_tokens=K), oracle))


def alpha_report(alphas: dict[str, float], tmp_path):
    rows = [ResultRow(domain=d, method="oracle", K=K, temperature=0.0, alpha=a, tau=2.0, a_k=[a] * K,
                      ms_per_token=5.0, tokens_per_s=200.0, speedup=1.5, predicted_speedup=None, ttft_p50=None,
                      ttft_p99=None, itl_p50=None, itl_p99=None, draft_time_share=None, target_time_share=None,
                      repetitions=1, spread=0.0) for d, a in alphas.items()]
    return write_report(Report(TargetInfo("t", "fp"), {}, rows), tmp_path / "report", plots=False).json


def send(client, prompts: dict[str, list[list[int]]], indices, clients: int = 8) -> set[int]:
    """Requests i = 0, 1, ...: even ones chat, odd ones code, cycling over each domain's prompts;
    `clients` at once, so the engine batches them as in serving. Returns the status codes."""
    body = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}

    def one(i: int) -> int:
        domain = ("chat", "code")[i % 2]
        prompt = prompts[domain][(i // 2) % len(prompts[domain])]
        return client.post("/v1/completions", json={**body, "prompt": prompt, "domain": domain}).status_code
    with ThreadPoolExecutor(clients) as pool:
        return set(pool.map(one, indices))


def served_alphas(srv) -> dict[str, float]:
    by_domain = srv.app.state.engine_loop.call(lambda e: e.stats().spec.by_domain).result(30)
    return {d: s.num_accepted / s.num_proposed for d, s in sorted(by_domain.items())}


MAX_TOKENS = 8


def test_the_server_reports_drift_on_one_domain_within_200_requests_and_never_without(tmp_path_factory, tmp_path):
    """Goal of the drift detector (default DriftConfig), over loopback with real per-request speculative
    stats: the draft's 'eval' alpha is measured by serving 400 requests; then 2,000 requests at that
    quality raise no event; after code's draft turns bad, an event is written (JSON line) within 200
    requests, the gauge shows it, and chat stays quiet. Prints the figures."""
    from draftsmith.serve_eval.engine import EngineConfig, LLMEngine
    from spec_helpers import run_engine

    model_dir = tiny_checkpoint(tmp_path_factory)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rng = random.Random(7)
    prompts = {d: [[rng.randrange(3, vocab) for _ in range(rng.randint(4, 12))] for _ in range(8)]
               for d in ("chat", "code")}
    flat = [p for d in sorted(prompts) for p in prompts[d]]
    plain = LLMEngine(EngineConfig(str(model_dir), **ENGINE_KWARGS))
    outs = run_engine(plain, flat, [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)] * len(flat))
    oracle = SwappableOracle({tuple(p): outs[f"r{i}"].output_token_ids for i, p in enumerate(flat)},
                             {"chat": 0.9, "code": 0.85}, vocab)
    with serve(spec_engine(model_dir, oracle)) as srv, httpx.Client(base_url=srv.base_url, timeout=60) as c:
        assert send(c, prompts, range(400)) == {200}
        eval_alphas = served_alphas(srv)
    report = alpha_report(eval_alphas, tmp_path)
    log = report.parent / "drift-events.jsonl"
    settings = DriftSettings(str(report), "oracle", K, 0.0, str(log), None, DriftConfig())
    with serve(spec_engine(model_dir, oracle), drift=settings) as srv, \
            httpx.Client(base_url=srv.base_url, timeout=60) as c:
        assert send(c, prompts, range(2000)) == {200}
        false_events = len(log.read_text().splitlines()) if log.exists() else 0
        served = served_alphas(srv)
        oracle.p_right["code"] = 0.3                    # the code slice's draft turns bad
        sent = 0
        while not log.exists() and sent < 200:
            assert send(c, prompts, [2 * sent + 1], clients=1) == {200}   # odd: code
            sent += 1
        print(f"\ndrift loopback (DriftConfig defaults): eval alpha "
              f"{ {d: round(a, 3) for d, a in eval_alphas.items()} }, served over 2,000 requests "
              f"{ {d: round(a, 3) for d, a in served.items()} }: {false_events} false event(s); code's draft "
              f"swapped to a bad one: " + (f"event after {sent} requests" if log.exists() else "no event in 200"))
        assert false_events == 0
        assert log.exists(), "no drift event within 200 requests"
        event = DriftEvent.from_file(log)
        assert event.domain == "code" and event.rolling_alpha < event.bar < event.reference_alpha
        assert event.method == "oracle" and event.target
        gauges = {dict(labels)["domain"]: v for (name, labels), v in parse_text(c.get("/metrics").text).items()
                  if name == "draftsmith:spec_alpha_drift"}
        assert gauges["code"] > settings.config.tolerance and abs(gauges["chat"]) < settings.config.tolerance
    assert len(log.read_text().splitlines()) == 1
