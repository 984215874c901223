"""Bad input fails with a ValueError naming the field, and the engine keeps serving everyone else."""
import pytest

from draftsmith.serve_eval.engine import EngineConfig, LLM, LLMEngine, SamplingParams

MAX_POS = 64


@pytest.fixture(scope="module")
def model_dir(family_checkpoint):
    return str(family_checkpoint("llama", hidden_size=32, intermediate_size=64, max_position_embeddings=MAX_POS))


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature="hot"), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(stop=5), "stop"),
    (dict(stop=["ok", 3]), "stop"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(stop_token_ids="12"), "stop_token_ids"),
    (dict(seed=1.5), "seed"),
    (dict(n=0), "n"),
    (dict(ignore_eos="yes"), "ignore_eos"),
])
def test_sampling_params_validation(kwargs, field):
    """Each invalid SamplingParams field raises ValueError whose message names that field."""
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_stop_accepts_a_single_string():
    """A lone stop string is normalized to a one-element list."""
    assert SamplingParams(stop="END").stop == ["END"]


def test_add_request_rejects_and_engine_keeps_serving(model_dir):
    """Empty prompt, prompt over the max length, prompt + max_tokens over it, bad token ids, text
    without a tokenizer, stop strings without a tokenizer, a duplicate id: each raises ValueError
    naming the field, and a valid request added before them still completes."""
    engine = LLMEngine(EngineConfig(model=model_dir, num_gpu_blocks=32, block_size=4))
    ok = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    engine.add_request("good", [1, 2, 3], ok)
    engine.step()
    cases = [
        (("e", [], ok), "prompt"),
        (("long", [1] * (MAX_POS + 1), ok), "max length"),
        (("fit", [1] * 40, SamplingParams(max_tokens=MAX_POS - 39)), "max_tokens"),
        (("ids", [1, 999], ok), "prompt"),
        (("ids2", [1, True], ok), "prompt"),
        (("txt", "hello", ok), "prompt"),
        (("obj", 42, ok), "prompt"),
        (("stop", [1], SamplingParams(stop=["x"])), "stop"),
        (("good", [1], ok), "request_id"),
        (("p", [1], {"temperature": 0}), "params"),
        (("n", [1], SamplingParams(n=65, max_tokens=5)), "n=65: at most 64 samples"),
    ]
    for args, field in cases:
        with pytest.raises(ValueError, match=field):
            engine.add_request(*args)
    with pytest.raises(ValueError, match="priority"):
        engine.add_request("prio", [1], ok, priority="high")
    assert set(engine.requests) == {"good"}
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == ["good"] and len(done[0].output_token_ids) == 5
    engine.kv.check_integrity()


def test_prompt_of_exactly_max_length_minus_output_fits(model_dir):
    """The boundary case prompt + max_tokens == max length is accepted and runs to completion."""
    llm = LLM(model_dir, num_gpu_blocks=32, block_size=4)
    (out,) = llm.generate([[3] * (MAX_POS - 4)], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                          use_tqdm=False)
    assert len(out.output_token_ids) == 4


def test_generate_is_all_or_nothing(model_dir):
    """One bad prompt in a generate() call raises and leaves no request of that call behind."""
    llm = LLM(model_dir, num_gpu_blocks=32, block_size=4)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[1, 2], []], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and llm.engine.kv.pool.num_used_blocks == 0
    with pytest.raises(ValueError, match="params"):
        llm.generate([[1], [2]], [SamplingParams()], use_tqdm=False)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(num_gpu_blocks=15, block_size=4), "num_gpu_blocks=15"),
    (dict(kv_cache_memory_gb=1e-6, block_size=4), "kv_cache_memory_gb"),
])
def test_budget_too_small_for_one_sequence(model_dir, kwargs, needle):
    """A KV budget below one max-length sequence fails at start, naming the blocks and bytes needed
    (64 tokens / 4 per block = 16 blocks; K+V * 2 layers * 4 tokens * 2 kv heads * 8 dims * 4 B = 1024 B each)."""
    with pytest.raises(ValueError, match=needle) as info:
        LLMEngine(EngineConfig(model=model_dir, **kwargs))
    assert "16 blocks" in str(info.value) and "16384 bytes" in str(info.value)


def test_bad_engine_config_values(model_dir):
    """Scheduler and cache settings are validated by name too."""
    for kwargs, field in [(dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
                          (dict(prefill_chunk_size=0), "prefill_chunk_size"),
                          (dict(free_block_watermark=1.5), "free_block_watermark"),
                          (dict(max_model_len=MAX_POS + 1), "max_model_len")]:
        with pytest.raises(ValueError, match=field):
            LLMEngine(EngineConfig(model=model_dir, num_gpu_blocks=32, block_size=4, **kwargs))
