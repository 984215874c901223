"""n > 1 over HTTP: one engine request per prompt samples all n choices (the prompt runs once), choice
prompt_index * n + i equals the engine's sample i, streamed chunks carry their choice's index, metrics
count each sample as a finished request, and a client leaving a stream frees every sample's blocks."""
from __future__ import annotations

import httpx

from draftsmith.serve_eval.engine.sampling_params import SamplingParams
from draftsmith.serve_eval.server.prom import parse_text
from server_helpers import SlowEngine, engine_call, kv_is_clean, make_engine, serve, wait_until
from test_server_http import sse_events

SAMPLED = {"temperature": 1.0, "top_p": 0.9, "seed": 11}


def streamed_texts(events: list, field) -> tuple[dict[int, str], dict[int, list]]:
    """Per choice index: the concatenated deltas, and the finish_reason of each of its chunks."""
    texts: dict[int, str] = {}
    reasons: dict[int, list] = {}
    for event in events[:-1]:
        for choice in event["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + (field(choice) or "")
            reasons.setdefault(choice["index"], []).append(choice["finish_reason"])
    return texts, reasons


def test_choices_are_the_engine_samples_and_the_prompt_is_admitted_once(client, reference):
    prompts = ["the dog and the bird", "one two three"]
    before = parse_text(client.get("/metrics").text)
    body = client.post("/v1/completions", json={"prompt": prompts, "n": 3, "max_tokens": 8,
                                                "ignore_eos": True, **SAMPLED}).json()
    after = parse_text(client.get("/metrics").text)
    want = reference.generate(prompts, SamplingParams(n=3, max_tokens=8, ignore_eos=True, temperature=1.0,
                                                      top_p=0.9, seed=11), use_tqdm=False)
    texts = {c["index"]: c["text"] for c in body["choices"]}
    assert texts == {p * 3 + c.index: c.text for p, out in enumerate(want) for c in out.completions}
    assert len(set(texts.values())) > 1
    prompt_lens = [len(out.prompt_token_ids) for out in want]
    # Prompt tokens enter the engine once per prompt, not once per choice; each choice finishes as a request.
    tokens = ("draftsmith:prompt_tokens_total", ())
    assert after[tokens] - before[tokens] == sum(prompt_lens) == body["usage"]["prompt_tokens"]
    finished = ("draftsmith:request_success_total", (("domain", "default"), ("finished_reason", "length")))
    assert after[finished] - before.get(finished, 0) == 6
    assert body["usage"]["completion_tokens"] == 6 * 8


def test_streamed_completion_choices_carry_their_index(client):
    req = {"prompt": ["tell me a story", "hello world"], "n": 2, "max_tokens": 10, **SAMPLED}
    full = {c["index"]: c for c in client.post("/v1/completions", json=req).json()["choices"]}
    with client.stream("POST", "/v1/completions", json={**req, "stream": True}) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    texts, reasons = streamed_texts(events, lambda c: c["text"])
    assert texts == {i: c["text"] for i, c in full.items()} and set(texts) == {0, 1, 2, 3}
    for index, seen in reasons.items():   # one finish_reason per choice, on its last chunk
        assert seen[-1] == full[index]["finish_reason"] and all(r is None for r in seen[:-1])


def test_streamed_chat_choices_open_with_role_and_carry_their_index(client):
    req = {"messages": [{"role": "user", "content": "hello world"}], "n": 3, "max_tokens": 9, **SAMPLED}
    body = client.post("/v1/chat/completions", json=req).json()
    full = {c["index"]: c["message"]["content"] for c in body["choices"]}
    with client.stream("POST", "/v1/chat/completions", json={**req, "stream": True}) as r:
        events = sse_events(r)
    openers = [e["choices"][0] for e in events[:3]]
    assert [c["index"] for c in openers] == [0, 1, 2] and all(c["delta"]["role"] == "assistant" for c in openers)
    texts, _ = streamed_texts(events, lambda c: c["delta"].get("content"))
    assert texts == full


def test_bad_n_names_n(client):
    for n in (0, -1, 1000):
        response = client.post("/v1/completions", json={"prompt": "hi", "n": n})
        assert response.status_code == 400 and response.json()["error"]["param"] == "n"


def test_leaving_an_n_stream_aborts_every_sample(ckpt):
    with serve(SlowEngine(make_engine(ckpt))) as srv:
        with httpx.Client(base_url=srv.base_url, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json={
                    "prompt": "tell me a story", "n": 3, "max_tokens": 110, "ignore_eos": True,
                    "stream": True, **SAMPLED}) as r:
                received = [line for line, _ in zip(r.iter_lines(), range(6))]
                assert any(line.startswith("data: ") for line in received)
            loop = srv.app.state.engine_loop
            wait_until(lambda: len(loop.abort_log) == 1, what="the abort")
            assert engine_call(srv, kv_is_clean)
            assert engine_call(srv, lambda engine: not engine.requests and not engine.sample_groups)
            counts = parse_text(c.get("/metrics").text)
            assert counts[("draftsmith:request_success_total",
                           (("domain", "default"), ("finished_reason", "abort")))] == 3
