#!/usr/bin/env python
"""Load test of the OpenAI-compatible server, in-process on loopback, bounded in count and time.

32 concurrent clients send 500 mixed requests (plain and streaming completions and chats,
some cancelled part-way, some invalid). Reports requests/s, TTFT and ITL p50/p99, how many
completed, failed as expected (400/404 for invalid input, cancelled by us), and were LOST
(anything else: a 5xx, a timeout, a stream without [DONE], a truncated answer), then checks
the KV block pool's integrity. With --spec it runs twice, speculation off then on, and
compares the greedy outputs of the two runs (speculation must not change them).

    python scripts/load_test.py                         # tiny random checkpoint, spec off
    python scripts/load_test.py --spec method=ngram,num_speculative_tokens=4 --json-out load.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from draftsmith.serve_eval.server.app import ServerConfig, create_app  # noqa: E402
from draftsmith.serve_eval.server.prom import parse_text  # noqa: E402
from draftsmith.serve_eval.server.run import build_speculative  # noqa: E402
from draftsmith.serve_eval.server.testing import WORDS, ServerThread, build_tiny_checkpoint  # noqa: E402
from draftsmith.serve_eval.speculative.metrics import percentile  # noqa: E402

INVALID = [  # (route, raw body): each must come back 400 (404 for the unknown model, as OpenAI's)
    ("completions", b'{"prompt": "hi", '),
    ("completions", b'{"max_tokens": 4}'),
    ("completions", b'{"prompt": "hi", "temperature": -1}'),
    ("completions", b'{"prompt": "hi", "top_p": 0}'),
    ("completions", b'{"prompt": "hi", "max_tokens": 0}'),
    ("completions", b'{"prompt": ""}'),
    ("completions", b'{"prompt": "hi", "model": "nope"}'),
    ("chat/completions", b'{"messages": []}'),
    ("chat/completions", b'{"messages": [{"role": "user", "content": 5}]}'),
    ("completions", json.dumps({"prompt": "w1 " * 5000}).encode()),
]


@dataclass
class Planned:
    index: int
    kind: str                 # "plain" | "stream" | "cancel" | "invalid"
    route: str
    body: dict | bytes
    cancel_after_chunks: int = 0


@dataclass
class Outcome:
    kind: str
    status: str               # "completed" | "expected_failure" | "rejected_429" | "lost"
    detail: str = ""
    ttft_s: float | None = None
    chunk_gaps_s: list[float] = field(default_factory=list)
    text: str | None = None


def plan(num_requests: int, seed: int) -> list[Planned]:
    rng = random.Random(seed)
    out = []
    for i in range(num_requests):
        roll = rng.random()
        if roll < 0.10:
            route, raw = rng.choice(INVALID)
            out.append(Planned(i, "invalid", route, raw))
            continue
        kind = "cancel" if roll < 0.20 else "stream" if roll < 0.55 else "plain"
        chat = rng.random() < 0.4
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 24)))
        body: dict = {"max_tokens": rng.randint(4, 48), "ignore_eos": rng.random() < 0.5,
                      "domain": rng.choice(["code", "prose", "chat"])}
        if rng.random() < 0.5:
            body["temperature"] = 0
        else:
            body.update(temperature=0.8, seed=rng.randint(0, 10**6))
        if chat:
            body["messages"] = [{"role": "user", "content": words}]
        else:
            body["prompt"] = words
        if kind != "plain":
            body.update(stream=True, stream_options={"include_usage": True})
        out.append(Planned(i, kind, "chat/completions" if chat else "completions", body,
                           cancel_after_chunks=rng.randint(1, 3)))
    return out


def _chunk_text(event: dict) -> str:
    choice = event["choices"][0]
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def run_one(client: httpx.AsyncClient, p: Planned, timeout_s: float) -> Outcome:
    url = f"/v1/{p.route}"
    try:
        if p.kind == "invalid":
            r = await client.post(url, content=p.body, headers={"Content-Type": "application/json"})
            ok = r.status_code in (400, 404) and "error" in r.json()
            return Outcome(p.kind, "expected_failure" if ok else "lost", f"HTTP {r.status_code}")
        if p.kind == "plain":
            r = await client.post(url, json=p.body, timeout=timeout_s)
            return _judge_plain(p, r)
        return await asyncio.wait_for(_run_stream(client, url, p), timeout_s)
    except Exception as exc:  # noqa: BLE001 - every failure is classified, none escapes
        return Outcome(p.kind, "lost", f"{type(exc).__name__}: {exc}")


def _judge_plain(p: Planned, r: httpx.Response) -> Outcome:
    if r.status_code == 429:
        return Outcome(p.kind, "rejected_429")
    if r.status_code != 200:
        return Outcome(p.kind, "lost", f"HTTP {r.status_code}: {r.text[:200]}")
    body = r.json()
    choice = body["choices"][0]
    text = choice.get("text", (choice.get("message") or {}).get("content"))
    return _judge_final(p, choice["finish_reason"], body["usage"]["completion_tokens"], text)


def _judge_final(p: Planned, finish_reason: str | None, completion_tokens: int, text: str) -> Outcome:
    """In full = a real finish reason, and a 'length' finish carries exactly max_tokens tokens."""
    if finish_reason not in ("stop", "length"):
        return Outcome(p.kind, "lost", f"finish_reason={finish_reason}")
    if finish_reason == "length" and completion_tokens != p.body["max_tokens"]:
        return Outcome(p.kind, "lost", f"length finish with {completion_tokens}/{p.body['max_tokens']} tokens")
    return Outcome(p.kind, "completed", text=text)


async def _run_stream(client: httpx.AsyncClient, url: str, p: Planned) -> Outcome:
    start = time.perf_counter()
    ttft, last, gaps, texts, finish, usage, chunks = None, None, [], [], None, None, 0
    async with client.stream("POST", url, json=p.body) as r:
        if r.status_code == 429:
            return Outcome(p.kind, "rejected_429")
        if r.status_code != 200:
            return Outcome(p.kind, "lost", f"HTTP {r.status_code}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[6:]
            if payload == "[DONE]":
                if finish is None or usage is None:
                    return Outcome(p.kind, "lost", "[DONE] without finish reason or usage")
                out = _judge_final(p, finish, usage["completion_tokens"], "".join(texts))
                out.ttft_s, out.chunk_gaps_s = ttft, gaps
                return out
            event = json.loads(payload)
            if event.get("usage"):
                usage = event["usage"]
            if not event["choices"]:
                continue
            now = time.perf_counter()
            text = _chunk_text(event)
            if text:
                if ttft is None:
                    ttft = now - start
                elif last is not None:
                    gaps.append(now - last)
                last = now
                texts.append(text)
                chunks += 1
            finish = event["choices"][0].get("finish_reason") or finish
            if p.kind == "cancel" and chunks >= p.cancel_after_chunks:
                return Outcome(p.kind, "expected_failure", "cancelled by client", ttft_s=ttft)
    if p.kind == "cancel":   # finished before we got to cancel it: still answered in full
        return Outcome(p.kind, "expected_failure", "finished before cancel")
    return Outcome(p.kind, "lost", "stream ended without [DONE]")


def _hist_quantile(samples: dict, name: str, q: float) -> float:
    """Prometheus histogram_quantile over the exposed cumulative buckets (linear in bucket)."""
    buckets = sorted((float(dict(labels)["le"].replace("+Inf", "inf")), v)
                     for (n, labels), v in samples.items() if n == name + "_bucket")
    total = buckets[-1][1] if buckets else 0
    if not total:
        return float("nan")
    rank, prev_bound, prev_count = q * total, 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return prev_bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / max(count - prev_count, 1e-12)
        prev_bound, prev_count = bound, count
    return prev_bound


async def drive(base_url: str, planned: list[Planned], concurrency: int, timeout_s: float) -> list[Outcome]:
    queue: asyncio.Queue[Planned] = asyncio.Queue()
    for p in planned:
        queue.put_nowait(p)
    outcomes: list[Outcome | None] = [None] * len(planned)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as client:
        async def worker() -> None:
            while not queue.empty():
                p = queue.get_nowait()
                outcomes[p.index] = await run_one(client, p, timeout_s)
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return [o or Outcome("?", "lost", "never ran") for o in outcomes]


def run(model_dir: str, args: argparse.Namespace, spec: str | None) -> dict:
    from draftsmith.serve_eval.engine.llm_engine import EngineConfig, LLMEngine
    speculative = build_speculative(spec)
    engine = LLMEngine(EngineConfig(model=model_dir, num_gpu_blocks=args.num_gpu_blocks,
                                    num_cpu_blocks=args.num_cpu_blocks,
                                    swap_threshold_tokens=args.swap_threshold_tokens,
                                    max_num_seqs=args.max_num_seqs), speculative=speculative)
    app = create_app(engine, ServerConfig(max_waiting_requests=args.max_waiting))
    planned = plan(args.requests, args.seed)
    with ServerThread(app) as server:
        start = time.perf_counter()
        outcomes = asyncio.run(asyncio.wait_for(
            drive(server.base_url, planned, args.concurrency, args.request_timeout), args.time_limit))
        wall = time.perf_counter() - start
        loop = app.state.engine_loop

        def settle(eng):   # aborts of cancelled streams are applied before this runs
            return eng.has_unfinished_requests()
        deadline = time.monotonic() + 30
        while loop.call(settle).result(30) and time.monotonic() < deadline:
            time.sleep(0.05)

        def integrity(eng) -> dict:
            eng.kv.check_integrity()
            s = eng.stats()
            return {"ok": s.kv_blocks_used == 0 and not eng.has_unfinished_requests(),
                    "used": s.kv_blocks_used, "cached": s.kv_blocks_cached, "free": s.kv_blocks_free,
                    "preemptions": s.num_preemptions, "swap_preemptions": s.num_swap_preemptions}
        try:
            pool = loop.call(integrity).result(30)
        except AssertionError as exc:
            pool = {"ok": False, "error": str(exc)}
        samples = parse_text(httpx.get(server.base_url + "/metrics").text)
    counts = {s: sum(o.status == s for o in outcomes)
              for s in ("completed", "expected_failure", "rejected_429", "lost")}
    ttfts = [o.ttft_s for o in outcomes if o.ttft_s is not None]
    gaps = [g for o in outcomes for g in o.chunk_gaps_s]
    ms = lambda v: round(1000 * v, 2)   # noqa: E731
    return {
        "spec": spec or "off", "requests": len(planned), "concurrency": args.concurrency,
        "wall_s": round(wall, 2), "requests_per_s": round(len(planned) / wall, 2),
        "completed_per_s": round(counts["completed"] / wall, 2), **counts,
        "lost_details": [f"#{i} {o.kind}: {o.detail}" for i, o in enumerate(outcomes) if o.status == "lost"][:10],
        "client_ttft_ms": {"p50": ms(percentile(ttfts, 50)), "p99": ms(percentile(ttfts, 99))},
        "client_inter_chunk_ms": {"p50": ms(percentile(gaps, 50)), "p99": ms(percentile(gaps, 99))},
        "server_ttft_ms": {q: ms(_hist_quantile(samples, "draftsmith:time_to_first_token_seconds", f))
                           for q, f in (("p50", .5), ("p99", .99))},
        "server_itl_ms": {q: ms(_hist_quantile(samples, "draftsmith:inter_token_latency_seconds", f))
                          for q, f in (("p50", .5), ("p99", .99))},
        "generated_tokens": int(samples[("draftsmith:generation_tokens_total", ())]),
        "spec_counters": {n: sum(v for (name, _), v in samples.items()
                                 if name == f"draftsmith:spec_decode_{n}_total")
                          for n in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")},
        "block_pool": pool,
        "_greedy_texts": {i: o.text for i, (p, o) in enumerate(zip(planned, outcomes))
                          if o.status == "completed" and isinstance(p.body, dict)
                          and p.body.get("temperature") == 0},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint dir (default: a tiny random Llama built in a temp dir)")
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--time-limit", type=float, default=600.0, help="seconds for the whole run")
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--spec", help="also run with speculation on, e.g. method=ngram,num_speculative_tokens=4")
    ap.add_argument("--num-gpu-blocks", type=int, default=512,
                    help="KV blocks (16 tokens each); a small budget forces preemption")
    ap.add_argument("--num-cpu-blocks", type=int, default=256, help="swap space, in blocks")
    ap.add_argument("--swap-threshold-tokens", type=int, default=512,
                    help="preempt by swap at/above this many tokens, by recompute below")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-waiting", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json-out")
    args = ap.parse_args()
    model_dir = args.model or str(build_tiny_checkpoint(tempfile.mkdtemp(prefix="load_test_"), max_position=256))
    reports = [run(model_dir, args, None)]
    if args.spec:
        try:
            reports.append(run(model_dir, args, args.spec))
        except (RuntimeError, ValueError) as exc:
            reports.append({"spec": args.spec, "unavailable": str(exc)})
    if len(reports) == 2 and "_greedy_texts" in reports[1]:
        off, on = reports[0]["_greedy_texts"], reports[1]["_greedy_texts"]
        common = off.keys() & on.keys()
        reports[1]["greedy_equal_to_spec_off"] = f"{sum(off[i] == on[i] for i in common)}/{len(common)}"
    for report in reports:
        report.pop("_greedy_texts", None)
        print(json.dumps(report, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(reports, indent=2))
    if any(r.get("lost") or not r.get("block_pool", {"ok": True})["ok"] for r in reports):
        sys.exit(1)


if __name__ == "__main__":
    main()
