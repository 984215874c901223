"""End-to-end: LLM.generate against transformers' greedy generate on a tiny random Llama (fp32),
plus stops, seeds, timings and abort."""
import random

import pytest
import torch

from draftsmith.serve_eval.engine import LLM, LLMEngine, EngineConfig, SamplingParams
from tiny_models import tiny_model, word_tokenizer

VOCAB, MAX_POS = 256, 160


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    model = tiny_model("llama", vocab_size=VOCAB, max_position_embeddings=MAX_POS, initializer_range=0.1,
                       eos_token_id=VOCAB - 1, bos_token_id=0, pad_token_id=0)
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path)
    word_tokenizer(VOCAB).save_pretrained(path)  # "w0".."w255": stop strings can be tested
    return path, model


def hf_greedy(model, prompt, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def workload(seed=0, n=6, shared_prefix=0):
    rng = random.Random(seed)
    system = [rng.randrange(1, VOCAB - 1) for _ in range(shared_prefix)]
    prompts = [system + [rng.randrange(1, VOCAB - 1) for _ in range(rng.randint(1, 40))] for _ in range(n)]
    lengths = [rng.randint(1, 30) for _ in range(n)]
    return prompts, lengths


@pytest.fixture(scope="module")
def references(model_dir):
    _, model = model_dir
    cache = {}

    def get(prompt, n):
        key = (tuple(prompt), n)
        if key not in cache:
            cache[key] = hf_greedy(model, prompt, n)
        return cache[key]
    return get


def run_and_compare(model_dir, references, prompts, lengths, llm=None, **engine_kwargs):
    llm = llm or LLM(model_dir[0], **{"num_gpu_blocks": 128, "block_size": 4, **engine_kwargs})
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, n, out in zip(prompts, lengths, outs):
        assert out.output_token_ids == references(prompt, n), f"prompt {prompt[:5]}..."
        assert out.finished and out.finish_reason == "length"
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.pool.num_used_blocks == 0, "blocks leaked after all requests finished"
    return llm


def test_single_prompt_matches_transformers(model_dir, references):
    """One request: greedy tokens equal transformers' greedy generate token for token."""
    run_and_compare(model_dir, references, [[5, 17, 42, 99, 3]], [24])


@pytest.mark.parametrize("caching", [True, False])
def test_batched_matches_transformers(model_dir, references, caching):
    """Mixed-length batch, with prefix caching on and off, shared system prompt: same tokens as
    transformers for every request; with caching on the shared prefix is actually hit (a second
    pass over the same prompts reads the blocks the first pass left cached)."""
    prompts, lengths = workload(seed=1, n=8, shared_prefix=24)
    llm = run_and_compare(model_dir, references, prompts, lengths, enable_prefix_caching=caching)
    run_and_compare(model_dir, references, prompts[::-1], lengths[::-1], llm=llm)
    assert (llm.engine.stats().prefix_cache_hit_rate > 0) == caching


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_forced_preemption_matches_transformers(model_dir, references, mode):
    """A pool that holds one max-length sequence (40 blocks of 4) and 6 requests with small chunks:
    preemption must happen (by recompute, or by swap to CPU) and outputs still equal transformers'."""
    prompts, lengths = workload(seed=2, n=6, shared_prefix=8)
    lengths = [n + 15 for n in lengths]
    kwargs = dict(num_gpu_blocks=40, prefill_chunk_size=8, max_num_batched_tokens=32, free_block_watermark=0.0)
    if mode == "swap":
        kwargs.update(swap_threshold_tokens=0, num_cpu_blocks=200)
    else:
        kwargs.update(swap_threshold_tokens=10**6, num_cpu_blocks=0)
    llm = run_and_compare(model_dir, references, prompts, lengths, **kwargs)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert (stats.num_swap_preemptions > 0) == (mode == "swap")


def test_stop_token_and_eos(model_dir, references):
    """A stop token id (and EOS without ignore_eos) ends the request right after that token."""
    prompt = [7, 8, 9]
    ref = references(prompt, 20)
    stop_tok = ref[5]
    expect = ref[:ref.index(stop_tok) + 1]
    llm = LLM(model_dir[0], num_gpu_blocks=64, block_size=4)
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_tok]),
                          use_tqdm=False)
    assert out.output_token_ids == expect and out.finish_reason == "stop"
    assert llm.engine.eos_token_ids == frozenset([VOCAB - 1])   # from config.json / tokenizer
    llm_eos = LLM(model_dir[0], num_gpu_blocks=64, block_size=4)
    llm_eos.engine.eos_token_ids = frozenset([stop_tok])   # pretend the model's EOS is that token
    (out,) = llm_eos.generate([prompt], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    assert out.output_token_ids == expect and out.finish_reason == "stop"
    (out,) = llm_eos.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                              use_tqdm=False)
    assert out.output_token_ids == ref


def test_stop_string_truncates_text(model_dir, references):
    """Generation ends at the first token whose decoded text contains the stop string; the text is
    cut just before it."""
    prompt = [11, 12, 13]
    ref = references(prompt, 20)
    llm = LLM(model_dir[0], num_gpu_blocks=64, block_size=4)
    stop = llm.tokenizer.decode([ref[4]])
    k = next(k for k in range(1, 21) if stop in llm.tokenizer.decode(ref[:k]))
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, stop=stop), use_tqdm=False)
    full = llm.tokenizer.decode(ref[:k])
    assert out.output_token_ids == ref[:k] and out.finish_reason == "stop"
    assert out.text == full[:full.find(stop)] and stop not in out.text


def test_text_prompts_and_metrics(model_dir):
    """Text prompts are tokenized; timings are ordered and one per output token."""
    llm = LLM(model_dir[0], num_gpu_blocks=64, block_size=4)
    (out,) = llm.generate("w5 w6 w7", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=True)
    assert out.prompt_token_ids == [5, 6, 7] and len(out.output_token_ids) == 6
    m = out.metrics
    assert m.arrival_time <= m.first_token_time == m.token_times[0] <= m.token_times[-1] <= m.finished_time
    assert len(m.token_times) == 6 and m.ttft >= 0
    assert out.text == llm.tokenizer.decode(out.output_token_ids, skip_special_tokens=True)


def test_seeded_sampling_is_batch_invariant(model_dir):
    """A seeded request samples the same tokens alone or among other requests; another seed differs."""
    llm = LLM(model_dir[0], num_gpu_blocks=128, block_size=4)
    p = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=123, max_tokens=16, ignore_eos=True)
    (alone,) = llm.generate([[1, 2, 3]], p, use_tqdm=False)
    others = SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True)
    batch = llm.generate([[4, 5], [1, 2, 3], [9] * 20], [others, p, others], use_tqdm=False)
    assert batch[1].output_token_ids == alone.output_token_ids
    (other_seed,) = llm.generate([[1, 2, 3]], SamplingParams(temperature=1.0, seed=7, max_tokens=16,
                                                             ignore_eos=True), use_tqdm=False)
    assert other_seed.output_token_ids != alone.output_token_ids


def test_abort_frees_blocks_at_once(model_dir):
    """Aborting a running request releases its blocks before the next step; others finish."""
    engine = LLMEngine(EngineConfig(model=str(model_dir[0]), num_gpu_blocks=64, block_size=4,
                                    enable_prefix_caching=False))
    engine.add_request("a", list(range(1, 30)), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    engine.add_request("b", list(range(2, 12)), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    engine.step()
    held = engine.kv.num_blocks_held(engine.requests["a"])
    used = engine.kv.pool.num_used_blocks
    engine.abort("a")
    assert engine.kv.pool.num_used_blocks == used - held
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["b"] and engine.kv.pool.num_used_blocks == 0
    engine.kv.check_integrity()
