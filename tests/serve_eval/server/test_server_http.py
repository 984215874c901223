"""The OpenAI-compatible server over real HTTP on loopback, against the real engine."""
from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from draftsmith.serve_eval.engine.sampling_params import SamplingParams
from draftsmith.serve_eval.server.engine_loop import Aborted, EngineLoop
from draftsmith.serve_eval.server.prom import parse_text
from server_helpers import (ENGINE_KWARGS, SlowEngine, engine_call, kv_is_clean, make_engine, serve,
                            wait_until)

PROMPTS = ["hello world", "tell me a story about the cat", "one two three four", "write python code"]


def sse_events(response_or_lines) -> list:
    """Parsed `data:` payloads of an SSE response (or of its remaining lines); the [DONE]
    sentinel kept as a string."""
    lines = response_or_lines.iter_lines() if isinstance(response_or_lines, httpx.Response) \
        else response_or_lines
    events = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def metrics(client: httpx.Client) -> dict:
    return parse_text(client.get("/metrics").text)


def test_completions_equal_llm_generate_at_temperature_0(client, reference):
    """Greedy text, token count and finish reason over HTTP equal LLM.generate's, for several
    prompts sent concurrently (so they share engine steps)."""
    expected = reference.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    results = [None] * len(PROMPTS)

    def post(i: int) -> None:
        results[i] = client.post("/v1/completions", json={
            "model": client.get("/v1/models").json()["data"][0]["id"],
            "prompt": PROMPTS[i], "max_tokens": 12, "temperature": 0})

    threads = [threading.Thread(target=post, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for response, want in zip(results, expected):
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["object"] == "text_completion"
        choice = body["choices"][0]
        assert choice["text"] == want.text
        assert choice["finish_reason"] == want.finish_reason
        assert body["usage"]["completion_tokens"] == len(want.output_token_ids)
        assert body["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
        assert body["usage"]["total_tokens"] == len(want.prompt_token_ids) + len(want.output_token_ids)


def test_chat_uses_the_tokenizer_chat_template(client, reference):
    """A chat request generates from the tokenizer's chat template (generation prompt added):
    the reply equals LLM.generate on the templated token ids."""
    messages = [{"role": "system", "content": "be happy"}, {"role": "user", "content": "tell me a story"}]
    tok = reference.tokenizer
    prompt_ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)["input_ids"]
    want = reference.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    response = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 10,
                                                         "temperature": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": want.text}
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)


def test_token_id_prompt_and_batched_prompts(client, reference):
    """Prompts given as token ids, and a list of prompts with n=2, give one choice per
    (prompt, sample) with OpenAI's index = prompt_index * n + i; usage counts each prompt once."""
    ids = reference.tokenizer("hello world")["input_ids"]
    ids2 = reference.tokenizer("one two three four")["input_ids"]
    want = reference.generate([ids, ids2], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    body = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 6, "temperature": 0}).json()
    assert body["choices"][0]["text"] == want[0].text
    body = client.post("/v1/completions", json={"prompt": [ids, ids2], "n": 2,
                                                "max_tokens": 6, "temperature": 0}).json()
    texts = {c["index"]: c["text"] for c in body["choices"]}
    assert texts == {0: want[0].text, 1: want[0].text, 2: want[1].text, 3: want[1].text}
    assert body["usage"]["prompt_tokens"] == len(want[0].prompt_token_ids) + len(want[1].prompt_token_ids)


def test_seeded_sampling_with_n_matches_engine(client, reference):
    """n samples with a seed: choice i is sampled with seed + i, so each equals LLM.generate
    with that seed, and repeating the request repeats the choices."""
    req = {"prompt": "the dog and the bird", "max_tokens": 8, "temperature": 1.0, "top_p": 0.9,
           "n": 3, "seed": 11}
    first = client.post("/v1/completions", json=req).json()
    second = client.post("/v1/completions", json=req).json()
    assert [c["text"] for c in first["choices"]] == [c["text"] for c in second["choices"]]
    want = reference.generate(["the dog and the bird"] * 3,
                              [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, seed=11 + i)
                               for i in range(3)], use_tqdm=False)
    assert [c["text"] for c in sorted(first["choices"], key=lambda c: c["index"])] == [w.text for w in want]


def test_streaming_completion_concatenates_to_the_full_text(client):
    """SSE chunks concatenate to the non-streamed text; the stream carries a finish reason,
    then a usage chunk (include_usage), then ends with `data: [DONE]`."""
    req = {"prompt": "tell me a story about the cat", "max_tokens": 14, "temperature": 0}
    full = client.post("/v1/completions", json=req).json()
    with client.stream("POST", "/v1/completions", json={**req, "stream": True,
                                                        "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    usage_event = events[-2]
    assert usage_event["choices"] == [] and usage_event["usage"] == full["usage"]
    chunks = events[:-2]
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == full["choices"][0]["finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_streaming_chat_opens_with_role_and_ends_with_done(client):
    """Chat streaming: first delta carries the assistant role, content deltas concatenate to
    the non-streamed message, no usage chunk unless asked, `data: [DONE]` last."""
    req = {"messages": [{"role": "user", "content": "hello world"}], "max_tokens": 9, "temperature": 0}
    full = client.post("/v1/chat/completions", json=req).json()
    with client.stream("POST", "/v1/chat/completions", json={**req, "stream": True}) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert content == full["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == full["choices"][0]["finish_reason"]


def test_stop_string_cuts_text_streamed_or_not(client, reference):
    """A stop string taken from the greedy output ends the text just before it, with
    finish_reason 'stop', identically streamed and not streamed."""
    greedy = reference.generate(["write python code"], SamplingParams(temperature=0, max_tokens=16),
                                use_tqdm=False)[0].text
    words = greedy.split(" ")
    stop = " ".join(words[3:5])
    expected = greedy[:greedy.find(stop)]
    req = {"prompt": "write python code", "max_tokens": 16, "temperature": 0, "stop": [stop]}
    body = client.post("/v1/completions", json=req).json()
    assert body["choices"][0]["text"] == expected
    assert body["choices"][0]["finish_reason"] == "stop"
    with client.stream("POST", "/v1/completions", json={**req, "stream": True}) as r:
        events = sse_events(r)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == expected


def test_models_health_unknown_routes(client):
    """/v1/models lists the served model; /health is ok; unknown routes are 404 and wrong
    methods 405, both with an OpenAI-style error body."""
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["max_model_len"] == 128
    assert client.get("/health").json() == {"status": "ok", "engine_restarts": 0, "last_engine_error": None}
    for method, path, status in [("GET", "/v1/nothing", 404), ("POST", "/v2/completions", 404),
                                 ("GET", "/v1/completions", 405)]:
        response = client.request(method, path)
        assert response.status_code == status
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert client.get("/v1/completions").headers["allow"] == "POST"


def test_metrics_are_exposed_and_move(client):
    """/metrics speaks Prometheus text; a request moves the request, token and latency
    series; KV block gauges add up to the pool; spec counters exist (zeros without a draft)."""
    before = metrics(client)
    client.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 5, "temperature": 0,
                                         "domain": "chat"})
    after = metrics(client)
    assert client.get("/metrics").headers["content-type"].startswith("text/plain; version=0.0.4")
    key = ("draftsmith:request_success_total", (("domain", "chat"), ("finished_reason", "length")))
    assert after[key] == before.get(key, 0) + 1
    gen = ("draftsmith:generation_tokens_total", ())
    assert after[gen] == before[gen] + 5
    ttft = ("draftsmith:time_to_first_token_seconds_count", ())
    assert after[ttft] == before[ttft] + 1
    itl = ("draftsmith:inter_token_latency_seconds_count", ())
    assert after[itl] == before[itl] + 4
    e2e = ("draftsmith:e2e_request_latency_seconds_count", ())
    assert after[e2e] == before[e2e] + 1
    blocks = sum(after[("draftsmith:kv_cache_blocks", (("state", s),))] for s in ("used", "cached", "free"))
    assert blocks == ENGINE_KWARGS["num_gpu_blocks"]
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert after[(f"draftsmith:spec_decode_{name}_total", (("domain", "default"),))] == 0
    assert ("draftsmith:spec_decode_num_accepted_tokens_per_pos_total",
            (("domain", "default"), ("position", "0"))) in after
    for name in ("num_requests_running", "num_requests_waiting", "prefix_cache_hit_rate",
                 "generation_tokens_per_second", "num_preemptions_total"):
        assert (f"draftsmith:{name}", ()) in after
    assert after[("draftsmith:http_requests_total", (("route", "/v1/completions"), ("status", "200")))] >= 1


def test_api_key_required_when_configured(ckpt):
    """With an API key set: /v1/* without or with a wrong key is 401 (OpenAI error body),
    the right Bearer key is served; /health stays open."""
    with serve(make_engine(ckpt), api_key="s3cret") as srv, httpx.Client(base_url=srv.base_url) as c:
        req = {"prompt": "hello", "max_tokens": 2}
        assert c.post("/v1/completions", json=req).status_code == 401
        wrong = c.post("/v1/completions", json=req, headers={"Authorization": "Bearer s3creT"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/v1/models", headers={"Authorization": "s3cret"}).status_code == 401
        ok = c.post("/v1/completions", json=req, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        assert c.get("/health").status_code == 200


def test_disconnect_mid_stream_aborts_within_one_step_and_frees_blocks(ckpt):
    """A client that drops a stream has its request aborted before the engine's next step
    (abort_log: applied at most one step after it was asked); its KV blocks return to the
    pool (check_integrity passes, none used) and the server keeps serving."""
    with serve(SlowEngine(make_engine(ckpt))) as srv:
        with httpx.Client(base_url=srv.base_url, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json={
                    "prompt": "tell me a story", "max_tokens": 110, "ignore_eos": True,
                    "temperature": 0, "stream": True}) as r:
                lines = r.iter_lines()
                received = [line for line, _ in zip(lines, range(3))]
                assert all(line.startswith("data: ") or line == "" for line in received)
            # leaving the block closed the connection mid-stream
            loop = srv.app.state.engine_loop
            wait_until(lambda: len(loop.abort_log) == 1, what="the abort")
            _, asked_at, applied_at = loop.abort_log[0]
            assert applied_at - asked_at <= 1
            assert engine_call(srv, kv_is_clean)
            done = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3, "temperature": 0})
            assert done.status_code == 200
            counts = parse_text(c.get("/metrics").text)
            assert counts[("draftsmith:request_success_total",
                           (("domain", "default"), ("finished_reason", "abort")))] == 1


def test_flooded_queue_answers_429_with_retry_after(ckpt):
    """With one running slot and a waiting bound of 1, a third concurrent request is refused
    with 429 + Retry-After (OpenAI rate-limit error body); the admitted ones complete."""
    engine = SlowEngine(make_engine(ckpt, max_num_seqs=1), step_delay_s=0.03)
    with serve(engine, max_waiting_requests=1, retry_after_s=2) as srv:
        with httpx.Client(base_url=srv.base_url, timeout=60) as c:
            # A holds the only slot for up to ~110 slow steps; it is read to the end below.
            with c.stream("POST", "/v1/completions", json={
                    "prompt": "tell me a story", "max_tokens": 110, "ignore_eos": True, "stream": True,
                    "temperature": 0}) as running:
                lines = running.iter_lines()   # kept: dropping it would close the connection
                next(lines)                    # A is running
                waiting: dict = {}
                t = threading.Thread(target=lambda: waiting.update(r=c.post("/v1/completions", json={
                    "prompt": "hello world", "max_tokens": 4, "temperature": 0})))
                t.start()
                wait_until(lambda: metrics(c)[("draftsmith:num_requests_waiting", ())] == 1,
                           what="B to wait")
                refused = c.post("/v1/completions", json={"prompt": "one two", "max_tokens": 4})
                assert refused.status_code == 429
                assert refused.headers["retry-after"] == "2"
                assert refused.json()["error"]["type"] == "rate_limit_error"
                events = sse_events(lines)
            t.join()
            assert events[-1] == "[DONE]"
            assert waiting["r"].status_code == 200
            assert engine_call(srv, kv_is_clean)


def test_priority_field_reaches_the_scheduler_tiers(ckpt):
    """With one running slot busy, a later request with a higher `priority` is served before
    an earlier one with the default priority (the scheduler's tiers, larger first)."""
    engine = SlowEngine(make_engine(ckpt, max_num_seqs=1), step_delay_s=0.03)
    with serve(engine) as srv, httpx.Client(base_url=srv.base_url, timeout=60) as c:
        finished: list[str] = []

        def post(name: str, priority: int) -> None:
            r = c.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 4,
                                                "priority": priority, "temperature": 0})
            assert r.status_code == 200
            finished.append(name)

        # A holds the only slot for up to ~110 slow steps; it is dropped once both wait.
        with c.stream("POST", "/v1/completions", json={
                "prompt": "tell me a story", "max_tokens": 110, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            next(lines)
            low = threading.Thread(target=post, args=("low", 0))
            low.start()
            wait_until(lambda: metrics(c)[("draftsmith:num_requests_waiting", ())] == 1, what="low waiting")
            high = threading.Thread(target=post, args=("high", 5))
            high.start()
            wait_until(lambda: metrics(c)[("draftsmith:num_requests_waiting", ())] >= 1
                       and srv.app.state.engine_loop.num_in_flight() == 3, what="high queued")
        # leaving the block disconnects A; both waiting requests now compete for the slot
        low.join()
        high.join()
        assert finished == ["high", "low"]


class FailingEngine(SlowEngine):
    """Test double: the real engine whose step() raises on the calls `fails(n)` picks (an engine bug)."""

    def __init__(self, engine, fails) -> None:
        super().__init__(engine, step_delay_s=0.0)
        self.calls, self.fails = 0, fails

    def step(self):
        self.calls += 1
        if self.fails(self.calls):
            raise RuntimeError("simulated engine failure")
        return super().step()


def CrashingEngine(engine) -> FailingEngine:   # every step from the 5th on
    return FailingEngine(engine, lambda n: n >= 5)


def FailOnceEngine(engine) -> FailingEngine:   # the 5th step only
    return FailingEngine(engine, lambda n: n == 5)


def test_a_failed_step_fails_its_requests_and_the_server_keeps_serving(ckpt):
    """The supervisor: a step that raises fails the requests in flight with an OpenAI-style
    error (a 500 body, or a final SSE error event then [DONE]), frees their blocks, and the next
    request is served normally; /health says ok and counts the restart."""
    with serve(FailOnceEngine(make_engine(ckpt))) as srv, httpx.Client(base_url=srv.base_url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "hello", "max_tokens": 50,
                                                       "ignore_eos": True, "stream": True}) as r:
            events = sse_events(r)
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "engine_error"
        assert "simulated engine failure" in events[-2]["error"]["message"]
        health = c.get("/health")
        assert health.status_code == 200 and health.json()["engine_restarts"] == 1
        assert "simulated engine failure" in health.json()["last_engine_error"]
        again = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        assert again.status_code == 200 and again.json()["choices"][0]["finish_reason"] == "length"
        assert engine_call(srv, kv_is_clean)


def test_a_crash_loop_stops_the_loop_loudly_instead_of_hanging(ckpt):
    """If every step raises, each request fails (500, engine_error) until the restart budget is
    spent; then /health turns 503 and new requests get 503 at once: nobody waits forever."""
    with serve(CrashingEngine(make_engine(ckpt))) as srv, httpx.Client(base_url=srv.base_url, timeout=60) as c:
        for _ in range(srv.app.state.engine_loop.config.max_restarts + 1):
            r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 50, "ignore_eos": True})
            assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
        assert c.get("/health").status_code == 503
        again = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        assert again.status_code == 503 and again.json()["error"]["type"] == "server_error"


def test_shutdown_aborts_in_flight_requests_and_returns_blocks(ckpt):
    """EngineLoop.shutdown with requests in flight: after the grace period each gets an
    Aborted marker, the engine holds no sequence and the block pool checks out."""
    engine = SlowEngine(make_engine(ckpt), step_delay_s=0.03)
    loop = EngineLoop(engine)
    loop.start()

    async def scenario():
        streams = [loop.submit(f"r{i}", [10 + i, 11, 12], SamplingParams(max_tokens=100, ignore_eos=True))
                   for i in range(3)]
        for s in streams:
            await s.accepted
        first = await streams[0].queue.get()          # generation is under way
        assert not first.finished
        await asyncio.get_running_loop().run_in_executor(None, loop.shutdown, 0.0)
        finals = []
        for s in streams:
            item = await s.queue.get()
            while not isinstance(item, Aborted):
                item = await s.queue.get()
            finals.append(item)
        return finals

    finals = asyncio.run(scenario())
    assert [a.request_id for a in finals] == ["r0", "r1", "r2"]
    assert not loop.alive
    assert kv_is_clean(engine)


def test_shutdown_lets_short_requests_finish_within_grace(ckpt):
    """Graceful shutdown: a request that finishes within the grace period is answered in full
    (finish_reason 'length'), not aborted."""
    engine = make_engine(ckpt)
    loop = EngineLoop(engine)
    loop.start()

    async def scenario():
        stream = loop.submit("short", [10, 11, 12], SamplingParams(max_tokens=5, ignore_eos=True))
        await stream.accepted
        await asyncio.get_running_loop().run_in_executor(None, loop.shutdown, 30.0)
        items = []
        while not stream.queue.empty():
            items.append(stream.queue.get_nowait())
        return items

    items = asyncio.run(scenario())
    assert items[-1].finished and items[-1].finish_reason == "length"
    assert len(items[-1].output_token_ids) == 5
    assert kv_is_clean(engine)


def test_prometheus_exposition_round_trips():
    """The hand-written exposition: histogram buckets are cumulative counts of values <= le,
    _count/_sum agree, counters end in _total, label values are escaped and parse back."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from draftsmith.serve_eval.server.prom import Registry

    @settings(max_examples=50, deadline=None)
    @given(values=st.lists(st.floats(0, 20, allow_nan=False), max_size=40),
           label=st.text(max_size=10))
    def check(values, label):
        reg = Registry()
        hist = reg.histogram("t:lat_seconds", "latency", (0.1, 1.0, 5.0))
        counter = reg.counter("t:events", "events", ("kind",))
        for v in values:
            hist.observe(v)
        counter.inc(3, kind=label)
        samples = parse_text(reg.render())
        for bound, le in ((0.1, "0.1"), (1.0, "1"), (5.0, "5"), (float("inf"), "+Inf")):
            assert samples[("t:lat_seconds_bucket", (("le", le),))] == sum(v <= bound for v in values)
        assert samples[("t:lat_seconds_count", ())] == len(values)
        assert samples[("t:lat_seconds_sum", ())] == pytest.approx(sum(values))
        escaped = label.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
        assert samples[("t:events_total", (("kind", escaped),))] == 3

    check()


def test_spec_counters_are_exposed_per_domain_and_position():
    """Engine spec stats (serve_eval.speculative.metrics.SpecStats per domain) become vLLM-named
    counters: drafts = rounds, draft tokens = proposed, accepted, and accepted per 0-based
    position, each labelled by domain."""
    from draftsmith.serve_eval.engine.outputs import EngineStats
    from draftsmith.serve_eval.server.metrics import ServerMetrics
    from draftsmith.serve_eval.speculative.metrics import SpecEngineStats, SpecStats

    code, chat = SpecStats(), SpecStats()
    code.record_round(4, 3)
    code.record_round(4, 1)
    chat.record_round(2, 0)
    stats = EngineStats(num_running=1, num_waiting=2, num_swapped=0, kv_blocks_total=10, kv_blocks_used=4,
                        kv_blocks_cached=1, kv_blocks_free=5, prefix_cache_hit_rate=0.25, num_preemptions=3,
                        num_swap_preemptions=1, num_steps=7,
                        spec=SpecEngineStats("eagle", SpecStats(), {"code": code, "chat": chat}, {}, {}))
    server_metrics = ServerMetrics()
    server_metrics.update_from_engine(stats)
    samples = parse_text(server_metrics.render())
    pre = "draftsmith:spec_decode_"
    assert samples[(pre + "num_drafts_total", (("domain", "code"),))] == 2
    assert samples[(pre + "num_draft_tokens_total", (("domain", "code"),))] == 8
    assert samples[(pre + "num_accepted_tokens_total", (("domain", "code"),))] == 4
    assert [samples[(pre + "num_accepted_tokens_per_pos_total", (("domain", "code"), ("position", str(k))))]
            for k in range(4)] == [2, 1, 1, 0]
    assert samples[(pre + "num_draft_tokens_total", (("domain", "chat"),))] == 2
    assert samples[(pre + "num_accepted_tokens_total", (("domain", "chat"),))] == 0
    assert samples[("draftsmith:num_requests_waiting", ())] == 2
    assert samples[("draftsmith:kv_cache_usage_perc", ())] == pytest.approx(0.4)
    assert samples[("draftsmith:prefix_cache_hit_rate", ())] == 0.25
    assert samples[("draftsmith:num_preemptions_total", ())] == 3


def test_speculative_server_matches_plain_greedy_and_counts_per_domain(ckpt, reference):
    """With n-gram speculation on, greedy outputs over HTTP still equal plain LLM.generate
    (exact verification), and the spec-decode counters move under the request's domain."""
    from draftsmith.serve_eval.speculative.config import SpecConfig
    from draftsmith.serve_eval.engine.llm_engine import EngineConfig, LLMEngine

    prompt = "one two three one two three one two three one two"
    want = reference.generate([prompt], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    engine = LLMEngine(EngineConfig(model=str(ckpt), **ENGINE_KWARGS),
                       speculative=SpecConfig(method="ngram", num_speculative_tokens=3))
    with serve(engine) as srv, httpx.Client(base_url=srv.base_url, timeout=60) as c:
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 24, "temperature": 0,
                                            "domain": "code"})
        assert r.json()["choices"][0]["text"] == want.text
        samples = metrics(c)
    drafts = samples[("draftsmith:spec_decode_num_drafts_total", (("domain", "code"),))]
    proposed = samples[("draftsmith:spec_decode_num_draft_tokens_total", (("domain", "code"),))]
    accepted = samples[("draftsmith:spec_decode_num_accepted_tokens_total", (("domain", "code"),))]
    per_pos = [v for (name, labels), v in samples.items()
               if name == "draftsmith:spec_decode_num_accepted_tokens_per_pos_total"
               and dict(labels)["domain"] == "code"]
    assert drafts > 0 and proposed >= drafts and 0 <= accepted <= proposed
    assert sum(per_pos) == accepted
