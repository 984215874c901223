"""The official `openai` Python client, unchanged, against the server on loopback."""
from __future__ import annotations

import openai
import pytest

from draftsmith.serve_eval.engine.sampling_params import SamplingParams
from server_helpers import make_engine, serve

API_KEY = "test-key"


@pytest.fixture(scope="module")
def server(ckpt):
    with serve(make_engine(ckpt), api_key=API_KEY, model_name="tiny-llama") as srv:
        yield srv


@pytest.fixture()
def client(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0,
                       timeout=60) as c:
        yield c


def test_models_list(client):
    """client.models.list() sees the one served model under its configured name."""
    assert [m.id for m in client.models.list()] == ["tiny-llama"]


def test_completion_equals_llm_generate(client, reference):
    """client.completions.create at temperature 0 returns LLM.generate's text and usage."""
    want = reference.generate(["the cat and the dog"], SamplingParams(temperature=0, max_tokens=10),
                              use_tqdm=False)[0]
    got = client.completions.create(model="tiny-llama", prompt="the cat and the dog", max_tokens=10,
                                    temperature=0)
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert got.usage.completion_tokens == len(want.output_token_ids)
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)


def test_chat_equals_llm_generate(client, reference):
    """client.chat.completions.create at temperature 0 returns LLM.generate's text on the
    chat-templated prompt, as an assistant message."""
    messages = [{"role": "user", "content": "tell me about the river"}]
    tok = reference.tokenizer
    ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
              add_special_tokens=False)["input_ids"]
    want = reference.generate([ids], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    got = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=8, temperature=0)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    assert got.usage.total_tokens == len(ids) + len(want.output_token_ids)


def test_streaming_chat_and_completion(client, reference):
    """stream=True through the client: the deltas rebuild LLM.generate's text, the last chunk
    carries the finish reason, and stream_options include_usage delivers usage."""
    want = reference.generate(["one two three"], SamplingParams(temperature=0, max_tokens=12),
                              use_tqdm=False)[0]
    stream = client.completions.create(model="tiny-llama", prompt="one two three", max_tokens=12,
                                       temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason
    assert chunks[-1].usage.completion_tokens == len(want.output_token_ids)

    messages = [{"role": "user", "content": "hello world"}]
    full = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=12, temperature=0)
    stream = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=12,
                                            temperature=0, stream=True)
    deltas = [c.choices[0].delta for c in stream]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == full.choices[0].message.content


def test_seed_and_n_through_client(client):
    """n and seed pass through: the same seeded request gives the same n choices twice."""
    kwargs = dict(model="tiny-llama", prompt="a big red fish", max_tokens=6, temperature=1.0, n=2, seed=3)
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert len(first.choices) == 2
    assert [c.text for c in first.choices] == [c.text for c in second.choices]


def test_client_errors_map_to_openai_exceptions(server, client):
    """Server refusals surface as the client's typed errors: bad parameter -> BadRequestError
    naming the field; unknown model -> NotFoundError on `model`; wrong key -> AuthenticationError."""
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny-llama", prompt="hello", temperature=-1)
    assert err.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["param"] == "model"
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="nope", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
