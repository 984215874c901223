"""A fuzzer nobody here wrote: schemathesis reads the server's own /openapi.json and throws
generated requests (valid and invalid) at every operation of a live server on loopback, with
speculation off and on. The assertions: no 5xx ever, and a server that is alive, healthy and
leak-free afterwards. Bounded example count and a fixed seed (derandomize) keep CI stable."""
from __future__ import annotations

import collections

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from draftsmith.serve_eval.engine.llm_engine import EngineConfig, LLMEngine
from draftsmith.serve_eval.server.run import build_speculative
from server_helpers import ENGINE_KWARGS, engine_call, kv_is_clean, serve

MAX_EXAMPLES = 40          # per operation and mode
CASES_SEEN: collections.Counter[tuple[str, str]] = collections.Counter()


@pytest.fixture(scope="module", params=["plain", "ngram-speculative"])
def fuzz_mode(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def fuzzed_server(fuzz_mode, ckpt):
    speculative = build_speculative("method=ngram,num_speculative_tokens=3") if fuzz_mode != "plain" else None
    engine = LLMEngine(EngineConfig(model=str(ckpt), **ENGINE_KWARGS), speculative=speculative)
    with serve(engine) as srv:
        yield srv


@pytest.mark.parametrize("generation", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                         ids=["valid", "invalid"])
def test_no_operation_ever_answers_5xx(fuzzed_server, fuzz_mode, generation):
    """Every operation of /openapi.json, with requests that fit the schema and requests built to
    break it: none gets a 5xx."""
    schema = schemathesis.openapi.from_url(f"{fuzzed_server.base_url}/openapi.json")
    for result in schema.get_all_operations():
        operation = result.ok()
        if generation is GenerationMode.NEGATIVE and not list(operation.body) and not list(operation.iter_parameters()):
            continue   # nothing to break in a GET without parameters (its valid cases run above)

        @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=generation))
        def one_case(case) -> None:
            response = case.call(base_url=fuzzed_server.base_url, timeout=60)
            CASES_SEEN[(fuzz_mode, f"{case.method} {case.path}")] += 1
            assert response.status_code < 500, (case.as_curl_command(), response.text)

        one_case()


def test_the_server_is_alive_healthy_and_leak_free_after_the_fuzzing(fuzzed_server, fuzz_mode):
    """Runs after the fuzzer in each mode (pytest keeps file order within a fixture's scope)."""
    operations = {op for mode, op in CASES_SEEN if mode == fuzz_mode}
    assert {"POST /v1/completions", "POST /v1/chat/completions", "GET /health"} <= operations
    print(f"fuzzer [{fuzz_mode}]: {len(operations)} operations, "
          f"{sum(n for (mode, _), n in CASES_SEEN.items() if mode == fuzz_mode)} cases")
    with httpx.Client(base_url=fuzzed_server.base_url, timeout=60) as client:
        health = client.get("/health")
        assert health.status_code == 200 and health.json()["engine_restarts"] == 0
        served = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3, "temperature": 0})
        assert served.status_code == 200
    assert engine_call(fuzzed_server, kv_is_clean)
