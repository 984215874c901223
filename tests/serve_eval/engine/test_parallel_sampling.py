"""Parallel sampling (SamplingParams.n > 1) through the real engine on a tiny random Llama (fp32).

Reference: n separate n == 1 requests seeded seed, seed + 1, ..., seed + n - 1. Each completion of one
n-request must be token-identical to its reference, in plain mode (also under recompute and swap
preemption on a tiny block pool, and with prefix caching) and with speculation (n-gram, a standalone
draft; the policy's fallback off so every round speculates K, as for the reference). The prompt runs
through the model once, its blocks are shared by the n samples and the shared partial last block is
copied on the first write; abort frees every sample.

Feature drafts (EAGLE-1/3, Medusa, block) keep per-request state built from the prompt's target features,
which only sample 0's prefill computes: the fork hands each sample a copy (Proposer.fork), so at T > 0 every
sample drafts, and takes its random draws, exactly as its n == 1 reference does.
Speculation at T > 0 under recompute preemption is not compared: a recomputed sequence's next token is
a plain sample of its re-prefill where an unpreempted one would have run a speculative round, so even two
n == 1 runs differ there (swap preemption keeps the rounds, and is compared).
"""
from __future__ import annotations

import pytest

from draftsmith.serve_eval.engine import EngineConfig, LLMEngine, SamplingParams
from draftsmith.serve_eval.speculative.config import SpecConfig
from draftsmith.serve_eval.speculative.policy import SpecPolicyConfig
from spec_helpers import feature_draft, make_llama, noisy_copy, workload

MAX_LEN = 64   # max_model_len: a tiny pool still holds one max-length sequence


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel_sampling")
    target = make_llama(root / "target")
    return target, noisy_copy(target, root / "draft", noise=0.05, seed=1)


def engine_for(target, speculative=None, **kw) -> LLMEngine:
    kw.setdefault("num_gpu_blocks", 256)
    kw.setdefault("block_size", 4)
    return LLMEngine(EngineConfig(str(target), max_model_len=MAX_LEN, **kw), speculative=speculative)


def run(engine: LLMEngine, requests: list[tuple[str, list[int], SamplingParams]]) -> dict:
    """Add all, step to the end checking the KV bookkeeping after every step; final outputs by id."""
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        engine.check_integrity()
    assert engine.kv.pool.num_used_blocks == 0 and not engine.requests and not engine.sample_groups
    return finals


def n_requests(num: int, n: int, seed: int, shared_prefix: int = 0, **params) -> list[tuple]:
    prompts, lengths = workload(num, seed=seed, shared_prefix=shared_prefix, max_len=14, max_out=20)
    return [(f"q{i}", prompt, SamplingParams(n=n, seed=100 * i, max_tokens=length, ignore_eos=True, **params))
            for i, (prompt, length) in enumerate(zip(prompts, lengths))]


def references(target, requests, speculative=None) -> dict[tuple[str, int], list[int]]:
    """(request id, sample index) -> the tokens of the n == 1 request seeded seed + index."""
    singles = [(f"{rid}/{i}", prompt, SamplingParams(**{**vars(p), "n": 1, "seed": p.seed + i}))
               for rid, prompt, p in requests for i in range(p.n)]
    outs = run(engine_for(target, speculative), singles)
    return {(rid, i): outs[f"{rid}/{i}"].output_token_ids for rid, _, p in requests for i in range(p.n)}


def assert_matches(finals, requests, refs) -> None:
    for rid, _, p in requests:
        out = finals[rid]
        assert [c.index for c in out.completions] == list(range(p.n))
        for c in out.completions:
            assert c.finished and c.output_token_ids == refs[(rid, c.index)], (rid, c.index)
        if p.temperature > 0:   # the seeds differ, so (almost surely) do the samples
            assert len({tuple(c.output_token_ids) for c in out.completions}) > 1


SAMPLED = dict(temperature=1.0, top_k=40, top_p=0.9)


@pytest.mark.parametrize("caching", [False, True])
def test_each_sample_matches_its_seeded_single_request(models, caching):
    target, _ = models
    requests = n_requests(4, n=3, seed=1, shared_prefix=6 if caching else 0, **SAMPLED)
    engine = engine_for(target, enable_prefix_caching=caching)
    refs = references(target, requests)
    assert_matches(run(engine, requests), requests, refs)
    # The same requests again: with caching their prompts' full blocks now come from the cache.
    assert_matches(run(engine, requests), requests, refs)
    assert (engine.stats().prefix_cache_hit_rate > 0) == caching


@pytest.mark.parametrize("swap", [False, True], ids=["recompute", "swap"])
def test_samples_match_under_preemption(models, swap):
    target, _ = models
    requests = n_requests(4, n=3, seed=2, **SAMPLED)
    engine = engine_for(target, num_gpu_blocks=20, num_cpu_blocks=64 if swap else 0,
                        swap_threshold_tokens=0 if swap else 10_000)
    assert_matches(run(engine, requests), requests, references(target, requests))
    stats = engine.stats()
    assert stats.num_preemptions > 0 and (stats.num_swap_preemptions > 0) == swap


def _spec(method: str, draft, k: int = 3) -> SpecConfig:
    return SpecConfig(method=method, draft_path=None if method == "ngram" else str(draft),
                      num_speculative_tokens=k, policy=SpecPolicyConfig(fallback=False))


@pytest.mark.parametrize("method", ["ngram", "standalone"])
def test_samples_match_with_speculation(models, method):
    target, draft = models
    requests = n_requests(4, n=3, seed=3, **SAMPLED)
    engine = engine_for(target, _spec(method, draft))
    assert_matches(run(engine, requests), requests, references(target, requests, _spec(method, draft)))
    assert engine.stats().spec.total.num_rounds > 0


@pytest.mark.parametrize("method", ["ngram", "standalone"])
def test_speculative_samples_match_under_preemption(models, method):
    """Swap preemption at T > 0, recompute preemption greedy (see the module docstring)."""
    target, draft = models
    sampled = n_requests(3, n=3, seed=4, **SAMPLED)
    swapping = engine_for(target, _spec(method, draft), num_gpu_blocks=22, num_cpu_blocks=64,
                          swap_threshold_tokens=0)
    assert_matches(run(swapping, sampled), sampled, references(target, sampled, _spec(method, draft)))
    greedy = n_requests(4, n=3, seed=5, temperature=0.0)
    recomputing = engine_for(target, _spec(method, draft), num_gpu_blocks=17, num_cpu_blocks=0)
    assert_matches(run(recomputing, greedy), greedy, references(target, greedy, _spec(method, draft)))
    assert swapping.stats().num_swap_preemptions > 0 and recomputing.stats().num_preemptions > 0


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "medusa", "block"])
def test_feature_draft_samples_match_at_t1(models, tmp_path, kind):
    """The forked samples start from the prompt's features: same tokens and the same speculative rounds as their
    seeded n == 1 references (a sample drafting without them would take other draws, and fewer rounds)."""
    target, _ = models
    draft = feature_draft(kind, target, tmp_path / kind)
    requests = n_requests(3, n=3, seed=7, **SAMPLED)
    engine, reference = engine_for(target, _spec(kind, draft)), engine_for(target, _spec(kind, draft))
    finals = run(engine, requests)
    singles = [(f"{rid}/{i}", prompt, SamplingParams(**{**vars(p), "n": 1, "seed": p.seed + i}))
               for rid, prompt, p in requests for i in range(p.n)]
    refs = run(reference, singles)
    assert_matches(finals, requests, {(rid, i): refs[f"{rid}/{i}"].output_token_ids
                                      for rid, _, p in requests for i in range(p.n)})
    rounds = engine.stats().spec.total.num_rounds
    assert rounds > 0 and rounds == reference.stats().spec.total.num_rounds


def test_feature_draft_samples_match_greedy(models, tmp_path):
    target, _ = models
    eagle = feature_draft("eagle", target, tmp_path / "eagle")
    requests = n_requests(3, n=3, seed=7, temperature=0.0)
    engine = engine_for(target, _spec("eagle", eagle))
    assert_matches(run(engine, requests), requests, references(target, requests, _spec("eagle", eagle)))
    assert engine.stats().spec.total.num_rounds > 0


def test_logprobs_and_first_token_stops(models):
    """Each sample's logprob records are its reference's; samples may finish at their first token."""
    target, _ = models
    requests = [("lp", [5, 6, 7, 8, 9], SamplingParams(n=3, seed=9, max_tokens=6, logprobs=2, ignore_eos=True,
                                                         **SAMPLED)),
                ("one", [3, 4, 5], SamplingParams(n=4, seed=1, max_tokens=1, **SAMPLED))]
    finals = run(engine_for(target), requests)
    singles = [(f"{rid}/{i}", prompt, SamplingParams(**{**vars(p), "n": 1, "seed": p.seed + i}))
               for rid, prompt, p in requests for i in range(p.n)]
    refs = run(engine_for(target), singles)
    for rid, _, p in requests:
        for c in finals[rid].completions:
            ref = refs[f"{rid}/{c.index}"]
            assert c.output_token_ids == ref.output_token_ids and c.finish_reason == ref.finish_reason
            if p.logprobs is not None:
                assert [r.token_id for r in c.logprobs] == c.output_token_ids
                for mine, theirs in zip(c.logprobs, ref.logprobs):
                    assert [t for t, _ in mine.top] == [t for t, _ in theirs.top]
                    assert [mine.logprob, *(v for _, v in mine.top)] == pytest.approx(
                        [theirs.logprob, *(v for _, v in theirs.top)], abs=1e-5)
    assert all(len(c.output_token_ids) == 1 for c in finals["one"].completions)


def test_greedy_n_gives_n_equal_completions(models):
    target, _ = models
    out = run(engine_for(target), [("g", [1, 2, 3, 4, 5], SamplingParams(n=3, temperature=0, max_tokens=8,
                                                                          ignore_eos=True))])["g"]
    assert len({tuple(c.output_token_ids) for c in out.completions}) == 1 and len(out.completions) == 3
    with pytest.raises(ValueError, match="n=3 completions"):
        out.output_token_ids   # the n == 1 view refuses to pick one


def test_prompt_runs_once_and_shared_partial_block_is_copied_on_write(models):
    """Prompt of 10 tokens, blocks of 4: after the prefill the 3 samples share 3 blocks (ref 3), the
    first 2 writers into the partial third block copy it, the last writes in place; the 2 full blocks
    stay shared. Tokens through the model: 10 once, then one per sample per decode step."""
    target, _ = models
    engine = engine_for(target, enable_prefix_caching=False)
    forwarded, copies = [], []
    forward, copy_blocks = engine.executor.forward, engine.executor.copy_blocks
    engine.executor.forward = lambda ids, *a, **k: forwarded.append(len(ids)) or forward(ids, *a, **k)
    engine.executor.copy_blocks = lambda pairs: copies.extend(pairs) or copy_blocks(pairs)
    engine.add_request("c", list(range(1, 11)), SamplingParams(n=3, seed=0, max_tokens=5, ignore_eos=True,
                                                               **SAMPLED))
    engine.step()
    seqs = engine.sample_groups["c"].samples
    tables = [engine.kv.block_tables[s.seq_id] for s in seqs]
    assert len(seqs) == 3 and all(t == tables[0] for t in tables) and len(tables[0]) == 3
    assert all(b.ref_cnt == 3 for b in tables[0])
    partial = tables[0][2].block_id
    engine.step()
    assert [src for src, _ in copies] == [partial, partial]
    after = [engine.kv.block_tables[s.seq_id] for s in seqs]
    assert all(t[:2] == tables[0][:2] for t in after) and all(b.ref_cnt == 3 for b in after[0][:2])
    assert len({t[2].block_id for t in after}) == 3
    run(engine, [])
    assert forwarded[0] == 10 and sum(forwarded) == 10 + 3 * 4


def test_abort_frees_every_sample(models):
    target, _ = models
    engine = engine_for(target, prefill_chunk_size=4)
    params = SamplingParams(n=3, seed=0, max_tokens=20, ignore_eos=True, **SAMPLED)
    engine.add_request("early", list(range(1, 13)), params)   # aborted mid-prefill, before the fork
    engine.add_request("late", list(range(2, 12)), params)    # aborted after the fork
    engine.add_request("other", [7, 8, 9], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    engine.step()
    engine.abort("early")
    while len(engine.sample_groups["late"].samples) < 3:
        engine.step()
    engine.abort("late#1")   # a sample's stream id is not a request id: ignored
    assert len([s for s in engine.sample_groups["late"].samples if not s.is_finished]) == 3
    engine.abort("late")
    engine.check_integrity()
    held = {seq.request_id for seq in engine.requests.values()}
    assert held == {"other"} and not engine.sample_groups
    finals = run(engine, [])
    assert list(finals) == ["other"]
    engine.add_request("again", [1, 2, 3], params)
    assert engine.abort_all() == ["again"] and engine.kv.pool.num_used_blocks == 0


@pytest.mark.parametrize("n, field", [(0, "n must be an int >= 1, got 0"), (-2, "n must be an int >= 1, got -2"),
                                      (5, "n=5: at most 4 samples per request"), (3, "n=3 exceeds max_num_seqs=2")])
def test_bad_n_names_n(models, n, field):
    target, _ = models
    engine = engine_for(target, max_samples_per_request=4 if n != 3 else 8, max_num_seqs=2 if n == 3 else 8)
    with pytest.raises(ValueError, match=field):
        engine.add_request("bad", [1, 2], SamplingParams(n=n, max_tokens=4))
    assert not engine.requests and not engine.sample_groups


def test_request_ids_never_clash_with_sample_streams(models):
    """Samples run under stream ids `<id>#<i>`: no request may take one of those, nor they its id."""
    target, _ = models
    engine = engine_for(target)
    engine.add_request("a", [1, 2, 3], SamplingParams(n=2, max_tokens=4))
    engine.add_request("b#0", [1], SamplingParams(max_tokens=2))
    for request_id, n in (("a", 1), ("a#1", 1), ("a#0", 2), ("b", 3)):
        with pytest.raises(ValueError, match=f"request_id {request_id!r} is already in use"):
            engine.add_request(request_id, [1, 2], SamplingParams(n=n, max_tokens=4))
    assert sorted(engine.abort_all()) == ["a", "b#0"]
    engine.check_integrity()
    assert engine.kv.pool.num_used_blocks == 0


def test_n_requests_share_max_num_seqs(models):
    """An unforked n-request is admitted only when its n samples fit max_num_seqs beside the running."""
    target, _ = models
    engine = engine_for(target, max_num_seqs=4)
    requests = n_requests(3, n=3, seed=6, **SAMPLED)
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    assert peak <= 4 and engine.kv.pool.num_used_blocks == 0
