"""External endpoint mode: measure any OpenAI-compatible server (ours, vLLM, SGLang) from outside.

Timing: POST /v1/completions with `stream: true`; TTFT = first content chunk - send, decode
ms/token = (last chunk - first chunk) / (completion tokens - 1) (token count from the final usage
chunk, else one per chunk), ITL = gaps between streamed chunks (a spec-decoding server sends several
tokens per chunk, as vLLM's benchmarks count it).
Acceptance: the Prometheus page is read before and after each pass; the counter deltas
(`<prefix>spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens`,
`..._num_accepted_tokens_per_pos{position}`, prefixes `vllm:` and `draftsmith:`, summed over other
labels) become one SpecStats, so alpha, tau and a_k use the same definitions as the engine's.
The counters are server-wide: other clients' traffic during the run would be counted too.
"""
from __future__ import annotations

import json
import os
import re
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

from draftsmith.serve_eval.eval.runners import RequestRecord, RunResult, RunSpec
from draftsmith.serve_eval.speculative.metrics import SpecStats

METRIC_PREFIXES = ("vllm:", "draftsmith:", "sglang:")
_SAMPLE_RE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$')
_now = time.perf_counter   # one name for the stream's clock (tests script it)
_LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


# ----------------------------------------------------------------------------- Prometheus

def parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Text exposition format -> {sample name: [(labels, value)]}; comments and bad lines skipped."""
    out: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE_RE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        labels = {k: v.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")
                  for k, v in _LABEL_RE.findall(m.group(2) or "")}
        out[m.group(1)].append((labels, value))
    return dict(out)


def _family(samples: dict[str, list], prefix: str, name: str) -> list[tuple[dict[str, str], float]] | None:
    """Samples of a counter, exposed as `<name>_total` (OpenMetrics) or bare `<name>`."""
    for key in (f"{prefix}{name}_total", f"{prefix}{name}"):
        if key in samples:
            return samples[key]
    return None


def read_spec_counters(text: str, K: int) -> SpecStats | None:
    """A server's cumulative spec-decode counters (vLLM's or ours, summed over label sets) as a SpecStats,
    or None when its /metrics has none. Without a drafts counter, rounds = draft tokens / K (chains);
    chains propose every position 1..K each round."""
    samples = parse_prometheus(text)
    for prefix in METRIC_PREFIXES:
        draft_tokens = _family(samples, prefix, "spec_decode_num_draft_tokens")
        accepted = _family(samples, prefix, "spec_decode_num_accepted_tokens")
        if draft_tokens is None or accepted is None:
            continue
        drafts = _family(samples, prefix, "spec_decode_num_drafts")
        per_pos: dict[int, float] = defaultdict(float)
        for labels, value in _family(samples, prefix, "spec_decode_num_accepted_tokens_per_pos") or []:
            if labels.get("position", "").isdigit():
                per_pos[int(labels["position"])] += value
        proposed = int(round(sum(v for _, v in draft_tokens)))
        rounds = int(round(sum(v for _, v in drafts))) if drafts is not None else (proposed // K if K > 0 else 0)
        positions = max(K, max(per_pos) + 1 if per_pos else 0) if per_pos else 0
        return SpecStats(num_rounds=rounds, num_proposed=proposed, num_accepted=int(round(sum(v for _, v in accepted))),
                         proposed_by_position=[rounds] * positions,
                         accepted_by_position=[int(round(per_pos.get(k, 0.0))) for k in range(positions)])
    return None


def spec_stats_of_run(before: SpecStats, after: SpecStats) -> SpecStats | None:
    """The rounds a run added to a server's counters; None when it proposed nothing."""
    delta = after.minus(before)
    return delta if delta.num_proposed > 0 and delta.num_rounds > 0 else None


# ----------------------------------------------------------------------------- streaming client

def stream_completion(client: httpx.Client, base_url: str, model: str, prompt: str, spec: RunSpec, seed: int,
                      domain: str | None, timeout_s: float) -> RequestRecord:
    """One streamed completion; chunk arrival times and the completion token count."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": spec.max_tokens,
                            "temperature": spec.temperature, "stream": True, "seed": seed,
                            "stream_options": {"include_usage": True}}
    if spec.ignore_eos:
        body["ignore_eos"] = True       # vLLM / draftsmith extension
    if spec.min_tokens:
        body["min_tokens"] = spec.min_tokens   # vLLM / draftsmith extension
    if domain is not None:
        body["domain"] = domain         # draftsmith extension: per-domain counters and settings
    times: list[float] = []
    usage_tokens: int | None = None
    sent = _now()
    with client.stream("POST", f"{base_url}/v1/completions", json=body, timeout=timeout_s) as resp:
        if resp.status_code != 200:
            resp.read()
            raise RuntimeError(f"{base_url}/v1/completions answered {resp.status_code}: {resp.text[:300]}")
        for line in resp.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage") and chunk["usage"].get("completion_tokens") is not None:
                usage_tokens = int(chunk["usage"]["completion_tokens"])
            if any(c.get("text") for c in chunk.get("choices") or []):
                times.append(_now())
    n = usage_tokens if usage_tokens is not None else len(times)
    return RequestRecord(n, times[0] - sent if times else None, times)


@dataclass
class EndpointTarget:
    name: str
    url: str
    model: str
    K: int
    headers: dict[str, str]
    timeout_s: float
    metrics_url: str
    send_domain: bool = False


def connect(entry: Any) -> EndpointTarget:
    """Check the server answers and pick its model; ValueError naming the endpoint when unreachable."""
    url = entry.url.rstrip("/")
    headers = {}
    if entry.api_key_env:
        key = os.environ.get(entry.api_key_env)
        if not key:
            raise ValueError(f"endpoint {entry.name}: environment variable {entry.api_key_env} is not set")
        headers["Authorization"] = f"Bearer {key}"
    try:
        resp = httpx.get(f"{url}/v1/models", headers=headers, timeout=min(entry.timeout_s, 10.0))
    except httpx.HTTPError as e:
        raise ValueError(f"endpoint {entry.name} at {url} is unreachable ({type(e).__name__}: {e})") from e
    if resp.status_code != 200:
        raise ValueError(f"endpoint {entry.name} at {url}: GET /v1/models answered {resp.status_code}")
    model = entry.model
    if model is None:
        ids = [m.get("id") for m in resp.json().get("data", [])]
        if not ids:
            raise ValueError(f"endpoint {entry.name} at {url}: /v1/models lists no model; set its `model`")
        model = ids[0]
    return EndpointTarget(entry.name, url, model, entry.K, headers, entry.timeout_s, url + entry.metrics_path,
                          getattr(entry, "send_domain", False))


class EndpointRunner:
    """Runner over an OpenAI-compatible server; `batch_size` requests in flight."""

    def __init__(self, target: EndpointTarget) -> None:
        self.target, self.method, self.K = target, target.name, target.K
        self.client = httpx.Client(headers=target.headers)

    def _counters(self) -> SpecStats | None:
        try:
            resp = self.client.get(self.target.metrics_url, timeout=10.0)
        except httpx.HTTPError:
            return None
        return read_spec_counters(resp.text, self.K) if resp.status_code == 200 else None

    def run(self, prompts: list[str], spec: RunSpec, domain: str) -> RunResult:
        t = self.target
        before = self._counters()
        start = time.perf_counter()
        send_domain = domain if t.send_domain else None

        def one(i: int) -> RequestRecord:
            return stream_completion(self.client, t.url, t.model, prompts[i], spec, spec.seed + i, send_domain,
                                     t.timeout_s)

        with ThreadPoolExecutor(max_workers=spec.batch_size) as pool:
            records = list(pool.map(one, range(len(prompts))))
        wall = time.perf_counter() - start
        after = self._counters()
        totals, notes = None, []
        if before is not None and after is not None:
            totals = spec_stats_of_run(before, after)
        elif t.K > 0:
            notes.append(f"{t.metrics_url}: no spec-decode counters; alpha and a_k not measured")
        return RunResult(records, wall, None, None, None, spec_totals=totals, notes=notes)

    def close(self) -> None:
        self.client.close()


def run_endpoint_eval(cfg: Any, prompts: dict[str, list[str]], target_path: str, fingerprint: str,
                      skipped: list | None = None) -> Any:
    """Every endpoint x domain x temperature -> Report. An endpoint named "no-spec" is the speed-up
    baseline; an unreachable endpoint is a skipped entry and the others still run."""
    from draftsmith.serve_eval.eval.harness import MethodPlan, assemble_report, run_cells
    from draftsmith.serve_eval.eval.report import BASELINE_METHOD

    entries = {e.name: e for e in cfg.endpoints}
    if len(entries) != len(cfg.endpoints):
        raise ValueError("eval.endpoints: names must be unique (they are the report's method labels)")
    plans = sorted((MethodPlan(e.name, e.K, framework="endpoint") for e in cfg.endpoints),
                   key=lambda p: p.method != BASELINE_METHOD)
    skipped = list(skipped or [])
    rows = run_cells(cfg, plans, prompts, lambda plan: EndpointRunner(connect(entries[plan.method])), skipped)
    notes = [f"endpoint {e.name}: {e.url} (K={e.K})" for e in cfg.endpoints]
    if BASELINE_METHOD not in entries:
        notes.append("no endpoint named 'no-spec': speed-ups not measured")
    return assemble_report(cfg, target_path, fingerprint, prompts, rows, skipped, notes, {})
