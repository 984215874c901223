"""Bad input never reaches the engine as a crash: each case is a 400 whose OpenAI-style body
names the field, never a 500, and the server keeps serving valid requests meanwhile."""
from __future__ import annotations

import json
import threading

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from draftsmith.serve_eval.server.prom import parse_text
from server_helpers import engine_call, kv_is_clean, make_engine, serve, tiny_checkpoint

MAX_MODEL_LEN = 128   # server_helpers.ENGINE_KWARGS
USER = [{"role": "user", "content": "hello"}]

# (route, body (dict, or raw bytes), expected `param`)
CASES = [
    ("completions", b'{"prompt": "hello", ', None),                    # malformed JSON
    ("completions", b"\xff\xfe not utf-8", None),
    ("completions", b"", None),                                          # empty body
    ("completions", b"[1, 2, 3]", None),                                 # not an object
    ("completions", {"max_tokens": 4}, "prompt"),                        # missing prompt
    ("chat/completions", {"max_tokens": 4}, "messages"),                 # missing messages
    ("chat/completions", {"messages": []}, "messages"),
    ("completions", {"prompt": 5}, "prompt"),                            # wrong types
    ("completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("completions", {"prompt": "hi", "max_tokens": "10"}, "max_tokens"),
    ("completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("completions", {"prompt": "hi", "n": 1.5}, "n"),
    ("completions", {"prompt": "hi", "seed": "x"}, "seed"),
    ("completions", {"prompt": "hi", "stop": 5}, "stop"),
    ("completions", {"prompt": "hi", "priority": "high"}, "priority"),
    ("chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ("chat/completions", {"messages": "hello"}, "messages"),
    ("completions", {"prompt": "hi", "temperature": -0.1}, "temperature"),   # out of range
    ("completions", {"prompt": "hi", "min_tokens": -1}, "min_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),   # more than max_tokens
    ("chat/completions", {"messages": USER, "temperature": -1}, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "hi", "top_p": 1.01}, "top_p"),
    ("completions", {"prompt": "hi", "top_k": -5}, "top_k"),
    # Valid as float64 / Python ints, broken in the dtypes the kernels use: these two used to
    # kill the engine loop (top_p 0.0 and temperature inf in float32).
    ("completions", {"prompt": "def f(", "max_tokens": 4, "top_p": 1e-50}, "top_p"),
    ("completions", {"prompt": "def f(", "max_tokens": 4, "temperature": 1e39}, "temperature"),
    ("chat/completions", {"messages": USER, "temperature": 1e-45}, "temperature"),
    ("completions", {"prompt": "hi", "top_k": 10**30}, "top_k"),
    ("completions", {"prompt": "hi", "seed": 1e23}, "seed"),
    ("completions", {"prompt": "hi", "seed": 2**70}, "seed"),
    ("completions", {"prompt": "hi", "seed": 2**63 - 1, "n": 2}, "seed"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": -3}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),   # beyond context
    ("chat/completions", {"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("chat/completions", {"messages": USER, "max_tokens": 10_000}, "max_tokens"),
    ("completions", {"prompt": "hi", "n": 0}, "n"),
    ("completions", {"prompt": "hi", "n": 1000}, "n"),
    ("completions", {"prompt": ""}, "prompt"),                           # empty prompts
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": [[]]}, "prompt"),
    ("completions", {"prompt": ["hi", ""]}, "prompt"),
    ("completions", {"prompt": [1, 2, 10**9]}, "prompt"),               # token id outside vocab
    ("completions", {"prompt": "w1 " * 200}, "prompt"),                  # over max length
    ("completions", {"prompt": list(range(10, 10 + MAX_MODEL_LEN))}, "prompt"),
    ("completions", {"prompt": "hi", "foo": 1}, "foo"),                  # unknown field
    ("completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),       # more than OpenAI's 20 alternatives
    ("completions", {"prompt": "hi", "logprobs": -1}, "logprobs"),
    ("completions", {"prompt": "hi", "logprobs": 2, "echo": True}, "echo"),
    ("chat/completions", {"messages": USER, "top_logprobs": 2}, "top_logprobs"),  # without logprobs=true
    ("chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("completions", {"prompt": "hi", "presence_penalty": 0.5}, "presence_penalty"),
    ("completions", {"prompt": "hi", "stop": [""]}, "stop"),
    ("completions", {"prompt": "hi", "domain": ""}, "domain"),
    ("chat/completions", {"messages": USER, "tools": [{"type": "function"}]}, "tools"),
    ("completions", {"prompt": "hi", "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve(make_engine(tiny_checkpoint(tmp_path_factory))) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


def post(client: httpx.Client, route: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return client.post(f"/v1/{route}", content=body, headers={"Content-Type": "application/json"})
    return client.post(f"/v1/{route}", json=body)


@pytest.mark.parametrize("route,body,param", CASES, ids=[f"{i}-{c[2]}" for i, c in enumerate(CASES)])
def test_bad_input_is_a_400_naming_the_field(client, route, body, param):
    """Each malformed request gets a 400 with an OpenAI error body whose `param` names the
    offending field (None where there is no field: broken JSON, a non-object body) and
    whose message mentions it."""
    response = post(client, route, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    if param is not None:
        assert param.split("[")[0].split(".")[0] in error["message"]


@pytest.mark.parametrize("route,body", [("completions", {"prompt": "hi", "model": "gpt-4"}),
                                        ("chat/completions", {"messages": USER, "model": "nope"})])
def test_unknown_model_is_a_404_naming_the_field(client, route, body):
    """As OpenAI and vLLM answer it: 404 with code model_not_found and param 'model'."""
    response = post(client, route, body)
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("model", "model_not_found")


def test_the_killer_requests_leave_the_server_serving(server, client):
    """Each request that once stopped the engine loop for good is a 400, and the very next valid
    request is served normally, /health staying ok."""
    for field, value in [("top_p", 1e-50), ("temperature", 1e39)]:
        for stream in (False, True):
            bad = post(client, "completions", {"prompt": "def f(", "max_tokens": 4, field: value,
                                                "stream": stream})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == field
            good = post(client, "completions", {"prompt": "def f(", "max_tokens": 4, "temperature": 0})
            assert good.status_code == 200 and good.json()["choices"][0]["finish_reason"] == "length"
            assert client.get("/health").status_code == 200
    assert engine_call(server, kv_is_clean)


def test_empty_chat_content_is_allowed(client):
    """An empty user message is still a valid conversation (the template adds its own
    tokens), unlike an empty completion prompt."""
    response = post(client, "chat/completions", {"messages": [{"role": "user", "content": ""}],
                                                 "max_tokens": 3})
    assert response.status_code == 200


def test_server_keeps_serving_during_a_barrage_of_bad_input(server, client):
    """A streaming request runs to [DONE] while every bad case is fired at the server; no 500
    appears in the request counters and the block pool checks out afterwards."""
    events: list[str] = []

    def stream() -> None:
        with client.stream("POST", "/v1/completions", json={
                "prompt": "tell me a story", "max_tokens": 40, "ignore_eos": True, "stream": True}) as r:
            events.extend(line for line in r.iter_lines() if line.startswith("data: "))

    worker = threading.Thread(target=stream)
    worker.start()
    for route, body, _ in CASES * 2:
        assert post(client, route, body).status_code == 400
    worker.join()
    assert events[-1] == "data: [DONE]"
    text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
    assert len(text.split()) >= 1
    counts = parse_text(client.get("/metrics").text)
    assert not any(name == "draftsmith:http_requests_total" and dict(labels)["status"].startswith("5")
                   for name, labels in counts)
    assert engine_call(server, kv_is_clean)


_json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12),
                          st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12))
_json_values = st.recursive(_json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=8)
_fields = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "n", "stop",
           "seed", "stream", "logprobs", "echo", "priority", "domain", "ignore_eos", "stop_token_ids",
           "min_tokens", "stream_options", "max_completion_tokens", "best_of", "user"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(["completions", "chat/completions"]),
       body=st.dictionaries(st.sampled_from(_fields), _json_values, max_size=6))
def test_random_json_never_gets_a_500(client, route, body):
    """Property: any JSON object of plausible fields with arbitrary values is answered 200 or
    400 (never 5xx), and a 400 always carries the OpenAI error body."""
    if isinstance(body.get("max_tokens"), int) and body.get("stream") is True:
        body["max_tokens"] = min(body["max_tokens"], 8)
    response = post(client, route, body)
    assert response.status_code in (200, 400, 404), response.text   # 404: an unknown `model`
    if response.status_code != 200:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_a_body_over_the_limit_is_a_413_before_it_is_read(tmp_path_factory):
    """Declared (Content-Length) and chunked bodies over max_request_body_bytes both get a 413
    with the OpenAI error body; a body under the limit is served."""
    with serve(make_engine(tiny_checkpoint(tmp_path_factory)), max_request_body_bytes=2048) as srv, \
            httpx.Client(base_url=srv.base_url, timeout=60) as c:
        big = json.dumps({"prompt": "x" * 4096, "max_tokens": 2}).encode()
        declared = c.post("/v1/completions", content=big, headers={"Content-Type": "application/json"})
        assert declared.status_code == 413 and declared.json()["error"]["code"] == "request_too_large"

        def chunks():
            for start in range(0, len(big), 512):
                yield big[start:start + 512]
        chunked = c.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
        assert chunked.status_code == 413
        assert c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2}).status_code == 200


def test_a_prompt_too_long_in_bytes_is_refused_before_tokenizing(server, client):
    """A prompt that cannot fit the context whatever its tokens is a 400 naming `prompt`, and
    the tokenizer never sees it (the bound is in bytes)."""
    serving = server.app.state.serving.prompts   # the prompt checks, with their tokenizer
    calls = []
    real_tokenizer = serving.tokenizer

    class CountingTokenizer:
        def __call__(self, text, **kwargs):
            calls.append(len(text))
            return real_tokenizer(text, **kwargs)

        def __getattr__(self, name):
            return getattr(real_tokenizer, name)

    serving.tokenizer = CountingTokenizer()
    try:
        response = post(client, "completions", {"prompt": "y" * (serving.max_prompt_bytes + 1)})
        messages = post(client, "chat/completions",
                        {"messages": [{"role": "user", "content": "y" * (serving.max_prompt_bytes + 1)}]})
    finally:
        serving.tokenizer = real_tokenizer
    for r, param in ((response, "prompt"), (messages, "messages")):
        assert r.status_code == 400 and r.json()["error"]["param"] == param
        assert r.json()["error"]["code"] == "context_length_exceeded"
    assert calls == []


def test_completions_default_to_16_tokens(client):
    """OpenAI's documented default for /v1/completions max_tokens is 16."""
    for extra in ({}, {"max_tokens": None}):
        body = post(client, "completions", {"prompt": "hello", "ignore_eos": True, "temperature": 0,
                                            **extra}).json()
        assert body["usage"]["completion_tokens"] == 16 and body["choices"][0]["finish_reason"] == "length"


def test_openapi_documents_every_route_with_its_body(client):
    """/openapi.json is served; the two OpenAI routes declare their JSON body by the very models
    that validate it, so fuzzers and clients see the real contract."""
    spec = client.get("/openapi.json").json()
    for path, model in [("/v1/completions", "CompletionRequest"),
                        ("/v1/chat/completions", "ChatCompletionRequest")]:
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
        component = spec["components"]["schemas"][model]
        assert component["additionalProperties"] is False and "temperature" in component["properties"]
    assert {"/v1/models", "/health", "/metrics"} <= set(spec["paths"])
