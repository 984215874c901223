"""Endpoint mode: Prometheus parsing (vLLM and draftsmith naming), streaming timing math on a scripted
clock, and a whole run against stub OpenAI-compatible streaming servers (one with spec counters, one
without, one unreachable)."""
from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from draftsmith.serve_eval.eval import endpoint
from draftsmith.serve_eval.eval.endpoint import (parse_prometheus, read_spec_counters, run_endpoint_eval, spec_stats_of_run,
                                      stream_completion)
from draftsmith.serve_eval.speculative.metrics import SpecStats
from draftsmith.serve_eval.eval.runners import RunSpec
from draftsmith.serve_eval.schemas import EndpointEntry, EvalConfig

VLLM_PAGE = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 40.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 120.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 60.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 30.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 20.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 10.0
vllm:num_requests_running{engine="0",model_name="m"} 0.0
"""


def test_read_vllm_counters_and_derive_alpha_tau_ak():
    """vLLM's counters -> SpecStats: alpha = accepted / draft tokens, tau = 1 + accepted / drafts,
    a_k = accepted at position k / drafts."""
    counters = read_spec_counters(VLLM_PAGE, K=3)
    assert (counters.num_rounds, counters.num_proposed, counters.num_accepted) == (40, 120, 60)
    assert counters.accepted_by_position == [30, 20, 10]
    stats = spec_stats_of_run(SpecStats(), counters)
    assert stats.alpha == pytest.approx(0.5)
    assert stats.tau == pytest.approx(2.5)
    assert stats.acceptance_by_position == pytest.approx([0.75, 0.5, 0.25])


def test_draftsmith_naming_sums_domains_and_handles_missing_drafts_counter():
    """Our server's `draftsmith:` counters carry a domain label: they are summed. Without a drafts
    counter, rounds = draft tokens / K. Escaped label values parse."""
    page = "\n".join([
        'draftsmith:spec_decode_num_draft_tokens_total{domain="code"} 8',
        'draftsmith:spec_decode_num_draft_tokens_total{domain="chat \\"x\\""} 4',
        'draftsmith:spec_decode_num_accepted_tokens_total{domain="code"} 5',
        'draftsmith:spec_decode_num_accepted_tokens_total{domain="chat \\"x\\""} 1',
        'draftsmith:spec_decode_num_accepted_tokens_per_pos_total{domain="code",position="0"} 3',
        'draftsmith:spec_decode_num_accepted_tokens_per_pos_total{domain="chat \\"x\\"",position="0"} 1',
        'draftsmith:spec_decode_num_accepted_tokens_per_pos_total{domain="code",position="1"} 2',
    ])
    assert parse_prometheus(page)["draftsmith:spec_decode_num_draft_tokens_total"][1][0] == {"domain": 'chat "x"'}
    stats = read_spec_counters(page, K=2)
    assert (stats.num_rounds, stats.alpha, stats.acceptance_by_position) == (6, 0.5, [4 / 6, 2 / 6])
    assert read_spec_counters("vllm:num_requests_running 0\n", K=2) is None
    assert spec_stats_of_run(stats, stats) is None   # a run that proposed nothing


def test_stream_timing_math_on_a_scripted_clock(monkeypatch):
    """TTFT = first content chunk - send; token count from the usage chunk; chunk times feed ms/token
    and ITL. The clock advances 1 s per reading, so every figure is exact."""
    chunks = [{"choices": [{"text": "a"}]}, {"choices": [{"text": ""}]}, {"choices": [{"text": "bc"}]},
              {"choices": [{"text": "def"}]}, {"choices": [], "usage": {"completion_tokens": 6}}]
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen.update(json.loads(request.content))
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    ticks = iter(range(100))
    monkeypatch.setattr(endpoint, "_now", lambda: float(next(ticks)))
    client = httpx.Client(transport=httpx.MockTransport(handler))
    rec = stream_completion(client, "http://stub", "m", "hi", RunSpec(0.0, 6, True, 0, 1), seed=7, domain="code",
                            timeout_s=5)
    assert seen["stream"] is True and seen["seed"] == 7 and seen["ignore_eos"] is True and seen["domain"] == "code"
    assert (rec.num_output_tokens, rec.ttft, rec.token_times) == (6, 1.0, [1.0, 2.0, 3.0])
    from draftsmith.serve_eval.eval.rows import run_ms_per_token
    from draftsmith.serve_eval.eval.runners import RunResult

    assert run_ms_per_token(RunResult([rec], 3.0)) == pytest.approx(1000 * (3.0 - 1.0) / 5)


class _Stub(BaseHTTPRequestHandler):
    """OpenAI-compatible streaming completions; /metrics in vLLM naming when `spec` is on, counters
    growing per request by (drafts 4, draft tokens 12, accepted 6, per position 3/2/1)."""

    protocol_version = "HTTP/1.0"

    def log_message(self, *args):
        pass

    def _send(self, code: int, text: str, ctype: str) -> None:
        data = text.encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        srv = self.server
        if self.path == "/v1/models":
            return self._send(200, json.dumps({"data": [{"id": "stub-model"}]}), "application/json")
        if self.path == "/metrics":
            with srv.lock:
                n = srv.served
            lines = ["vllm:num_requests_running 0"]
            if srv.spec:
                lines += [f"vllm:spec_decode_num_drafts_total {4 * n}",
                          f"vllm:spec_decode_num_draft_tokens_total {12 * n}",
                          f"vllm:spec_decode_num_accepted_tokens_total {6 * n}"]
                lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="{p}"}} {a * n}'
                          for p, a in enumerate((3, 2, 1))]
            return self._send(200, "\n".join(lines) + "\n", "text/plain")
        self._send(404, "{}", "application/json")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for text in ("x", "y z", "w"):
            self.wfile.write(f"data: {json.dumps({'choices': [{'text': text}]})}\n\n".encode())
            self.wfile.flush()
            time.sleep(0.002)
        usage = {"choices": [], "usage": {"completion_tokens": 4}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        with self.server.lock:
            self.server.served += 1


@pytest.fixture
def stub_servers():
    servers = []
    for spec in (False, True):
        srv = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
        srv.spec, srv.served, srv.lock, srv.requests = spec, 0, threading.Lock(), []
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
    yield servers
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_endpoint_run_against_stub_servers(stub_servers):
    """Two reachable servers and one dead one: rows for the reachable ones (alpha, tau, a_k from
    /metrics deltas of each pass, speed-up against the endpoint named no-spec), a skipped entry
    naming the dead one's URL, and every prompt sent with the configured sampling fields."""
    plain, spec = stub_servers
    url = lambda s: f"http://127.0.0.1:{s.server_address[1]}"  # noqa: E731
    dead = f"http://127.0.0.1:{_free_port()}"
    cfg = EvalConfig(mode="endpoint", repetitions=2, warmup=1, max_tokens=4, temperatures=[0.0], batch_size=2,
                     endpoints=[EndpointEntry("vllm-eagle", url(spec), K=3, timeout_s=10),
                                EndpointEntry("no-spec", url(plain), timeout_s=10),
                                EndpointEntry("gone", dead, K=2, timeout_s=2)])
    report = run_endpoint_eval(cfg, {"code": ["p1", "p2", "p3"]}, "", "fp")
    by = {r.method: r for r in report.results}
    assert set(by) == {"no-spec", "vllm-eagle"}
    eagle, base = by["vllm-eagle"], by["no-spec"]
    assert (eagle.alpha, eagle.tau, eagle.a_k) == (0.5, 2.5, [0.75, 0.5, 0.25])
    assert base.alpha is None and base.speedup == 1.0
    assert eagle.speedup == pytest.approx(base.ms_per_token / eagle.ms_per_token)
    assert eagle.repetitions == 2 and eagle.ttft_p50 is not None and eagle.ms_per_token > 0
    assert spec.served == 1 + 2 * 3   # warm-up prompt + two passes over three prompts
    assert {r["model"] for r in spec.requests} == {"stub-model"} and all(r["stream"] for r in spec.requests)
    gone = [s for s in report.skipped if s.method == "gone"]
    assert gone and "unreachable" in gone[0].reason and dead in gone[0].reason
