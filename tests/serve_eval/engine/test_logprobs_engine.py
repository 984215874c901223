"""SamplingParams.logprobs in the engine: per emitted token its logprob and the top-N (ids, logprobs) of the
target's raw log-softmax (fp32), on plain and speculative steps; greedy speculative logprobs equal plain ones."""
from __future__ import annotations

import shutil

import pytest
import torch

from draftsmith.serve_eval.engine import EngineConfig, LLMEngine, SamplingParams
from draftsmith.serve_eval.speculative.config import SpecConfig
from spec_helpers import feature_draft, make_llama, proposer_available, run_engine, workload

ENGINE = dict(block_size=4, max_model_len=96, prefill_chunk_size=16, max_num_batched_tokens=96, num_gpu_blocks=200)
TOP = 5


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("logprobs")
    target = make_llama(root / "target", layers=4, seed=0)
    shutil.copytree(target, root / "self")
    out = {"target": target, "self": root / "self", "standalone": make_llama(root / "draft", hidden=32, layers=1, seed=1)}
    if proposer_available("eagle3"):
        out["eagle3"] = feature_draft("eagle3", target, root / "eagle3")
    return out


def generate(models, params, method=None, extra=None, n=3):
    prompts, lengths = workload(n, seed=5, max_len=10, max_out=16)
    spec = None
    if method is not None:
        real = "standalone" if method == "self" else method
        spec = SpecConfig(real, draft_path=str(models[method]), num_speculative_tokens=3, **(extra or {}))
    engine = LLMEngine(EngineConfig(str(models["target"]), **ENGINE), speculative=spec)
    outs = run_engine(engine, prompts, [params(n) for n in lengths])
    return prompts, [outs[f"r{i}"] for i in range(n)]


def greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=TOP)


def test_plain_logprobs_are_transformers_log_softmax(models):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(models["target"]).eval()
    prompts, outs = generate(models, greedy)
    for prompt, out in zip(prompts, outs):
        assert len(out.logprobs) == len(out.output_token_ids)
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt + out.output_token_ids])).logits[0].float(), -1)
        for j, rec in enumerate(out.logprobs):
            row = ref[len(prompt) - 1 + j]  # the row token j was drawn from
            assert rec.token_id == out.output_token_ids[j]
            assert rec.logprob == pytest.approx(row[rec.token_id].item(), abs=1e-4)
            values, ids = row.topk(TOP)
            assert [i for i, _ in rec.top] == ids.tolist()
            assert [v for _, v in rec.top] == pytest.approx(values.tolist(), abs=1e-4)
            assert rec.top[0][0] == rec.token_id  # greedy: the emitted token is the most likely one


SPEC_CASES = [("self", {}), ("standalone", {}),
              ("eagle3", {"tree": "dynamic", "tree_top_k": 2, "tree_depth": 3, "max_draft_nodes": 8})]


@pytest.mark.parametrize("method,extra", SPEC_CASES, ids=[m for m, _ in SPEC_CASES])
def test_greedy_speculative_logprobs_equal_plain(models, method, extra):
    if method not in models:
        pytest.skip(f"{method} proposer not installed")
    _, plain = generate(models, greedy)
    _, spec = generate(models, greedy, method, extra)
    for a, b in zip(plain, spec):
        assert b.output_token_ids == a.output_token_ids
        assert len(b.logprobs) == len(a.logprobs)
        for x, y in zip(a.logprobs, b.logprobs):
            assert y.token_id == x.token_id
            assert y.logprob == pytest.approx(x.logprob, abs=1e-5)
            assert [i for i, _ in y.top] == [i for i, _ in x.top]
            assert [v for _, v in y.top] == pytest.approx([v for _, v in x.top], abs=1e-5)


def test_sampled_and_zero_top_and_none(models):
    sampled = lambda n: SamplingParams(temperature=0.9, seed=1, max_tokens=n, ignore_eos=True, logprobs=0)  # noqa: E731
    _, outs = generate(models, sampled, "self")
    for out in outs:
        assert [r.token_id for r in out.logprobs] == out.output_token_ids
        assert all(r.top == () and r.logprob <= 0.0 for r in out.logprobs)
    _, outs = generate(models, lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    assert all(out.logprobs is None for out in outs)


def test_too_many_logprobs_refused(models):
    engine = LLMEngine(EngineConfig(str(models["target"]), **ENGINE))
    with pytest.raises(ValueError, match="logprobs"):
        engine.add_request("x", [1, 2, 3], SamplingParams(logprobs=21))
