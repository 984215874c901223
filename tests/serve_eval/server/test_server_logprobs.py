"""OpenAI logprobs over HTTP: completions (tokens / token_logprobs / top_logprobs / text_offset) and chat
(logprobs: true + top_logprobs, content list), streamed and not, equal to the engine's records."""
from __future__ import annotations

import httpx
import pytest

from draftsmith.serve_eval.engine.sampling_params import SamplingParams
from server_helpers import make_engine, serve
from test_server_http import sse_events

PROMPT = "tell me a story about the cat"
TOP = 3


@pytest.fixture(scope="module")
def client(ckpt):
    with serve(make_engine(ckpt)) as srv, httpx.Client(base_url=srv.base_url, timeout=60) as c:
        yield c


def want(reference, prompt_ids, n=8):
    params = SamplingParams(temperature=0, max_tokens=n, logprobs=TOP, ignore_eos=True)
    return reference.generate([prompt_ids], params, use_tqdm=False)[0]


def test_completion_logprobs_streamed_and_not(client, reference):
    tok = reference.tokenizer
    out = want(reference, tok(PROMPT)["input_ids"])
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": TOP, "ignore_eos": True}
    lp = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    strings = [tok.decode([r.token_id]) for r in out.logprobs]
    assert lp["tokens"] == strings
    assert lp["token_logprobs"] == pytest.approx([r.logprob for r in out.logprobs], abs=1e-6)
    assert all(1 <= len(t) <= TOP for t in lp["top_logprobs"])  # ids decoding alike share one key
    assert max(lp["top_logprobs"][0].values()) == pytest.approx(lp["token_logprobs"][0], abs=1e-6)  # greedy
    assert lp["text_offset"] == [sum(len(s) for s in strings[:j]) for j in range(len(strings))]
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        events = [e for e in sse_events(response) if e != "[DONE]"]
    streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for event in events:
        chunk = event["choices"][0]["logprobs"]
        for key in streamed:
            streamed[key] += chunk[key] if chunk else []
    assert streamed == {k: lp[k] for k in streamed}


def test_chat_logprobs_streamed_and_not(client, reference):
    tok = reference.tokenizer
    messages = [{"role": "user", "content": "tell me a story"}]
    ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
              add_special_tokens=False)["input_ids"]
    out = want(reference, ids)
    body = {"messages": messages, "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": TOP,
            "ignore_eos": True}
    content = client.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [tok.decode([r.token_id]) for r in out.logprobs]
    assert [c["logprob"] for c in content] == pytest.approx([r.logprob for r in out.logprobs], abs=1e-6)
    for c, rec in zip(content, out.logprobs):
        assert [t["logprob"] for t in c["top_logprobs"]] == pytest.approx([v for _, v in rec.top], abs=1e-6)
        assert bytes(c["bytes"]).decode("utf-8") == c["token"]
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        events = [e for e in sse_events(response) if e != "[DONE]" and e.get("choices")]
    streamed = [c for e in events if e["choices"][0].get("logprobs") for c in e["choices"][0]["logprobs"]["content"]]
    assert [c["token"] for c in streamed] == [c["token"] for c in content]
    plain = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4}).json()
    assert plain["choices"][0]["logprobs"] is None
