"""The engine's intra-op thread count: the rule, and that the engine applies, logs and reports its choice."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import draftsmith
from draftsmith.serve_eval.engine import EngineConfig, LLMEngine, SamplingParams, threads
from draftsmith.serve_eval.engine.threads import (
    SMALL_MODEL_PARAMS,
    WIDE_STEP_TOKENS,
    choose_threads,
    estimate_num_params,
    threads_for,
)
from spec_helpers import feature_draft, make_llama


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_auto_rule_by_model_size_and_device():
    """auto: 1 thread for a small model on CPU, every core for a large one; a number is taken as is."""
    assert choose_threads("auto", SMALL_MODEL_PARAMS - 1, "cpu", cores=8).count == 1
    assert choose_threads("auto", 7 * 10**9, "cpu", cores=8).count == 8
    assert choose_threads(3, 10, "cpu", cores=8).count == 3
    with pytest.raises(ValueError, match="num_threads must be a positive int or 'auto', got 0"):
        choose_threads(0, 10, "cpu")
    with pytest.raises(ValueError, match="got 'many'"):
        choose_threads("many", 10, "cpu")


def test_param_estimate_matches_the_embedded_shape():
    """8 layers, hidden 256, MLP 704, GQA 4/2, vocab 4096, tied: about 6.95M parameters (norms excluded)."""
    cfg = SimpleNamespace(hidden_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=704, vocab_size=4096, tie_word_embeddings=True)
    assert abs(estimate_num_params(cfg) - 6_946_816) < 10_000


@pytest.mark.parametrize("setting,expected", [("auto", 1), (2, 2)])
def test_engine_applies_logs_and_reports_its_count(tmp_path, caplog, restore_threads, setting, expected):
    """The engine sets torch's intra-op count from EngineConfig.num_threads, logs it and puts it in stats()."""
    model = make_llama(tmp_path / "m")
    torch.set_num_threads(3 if expected != 3 else 2)
    with caplog.at_level(logging.INFO, logger="draftsmith.serve_eval.engine.threads"):
        engine = LLMEngine(EngineConfig(str(model), num_gpu_blocks=64, num_threads=setting))
    assert torch.get_num_threads() == expected
    assert engine.num_threads == expected and engine.stats().num_threads == expected
    assert f"engine: intra-op threads {expected}" in caplog.text and f"(num_threads={setting}" in caplog.text


def test_auto_rule_widens_large_steps_of_a_small_model():
    """auto on a small model: 1 thread below WIDE_STEP_TOKENS tokens per step, every core from there; one core
    or a configured count never widens."""
    small = choose_threads("auto", SMALL_MODEL_PARAMS - 1, "cpu", cores=2)
    assert [small.for_step(n) for n in (1, 5, WIDE_STEP_TOKENS - 1, WIDE_STEP_TOKENS, 512)] == [1, 1, 1, 2, 2]
    native = choose_threads("auto", SMALL_MODEL_PARAMS - 1, "cpu", cores=2, native_rows=64)   # the C layers' rows
    assert [native.for_step(n) for n in (1, WIDE_STEP_TOKENS, 64, 65, 512)] == [1, 1, 1, 2, 2]
    assert small.describe() == f"1 (2 from {WIDE_STEP_TOKENS} tokens per step)"
    assert choose_threads("auto", SMALL_MODEL_PARAMS - 1, "cpu", cores=1).for_step(512) == 1
    assert choose_threads(1, 10, "cpu", cores=2).for_step(512) == 1
    assert choose_threads("auto", 7 * 10**9, "cpu", cores=8).for_step(1) == 8


def test_the_native_kernels_split_over_the_cores_auto_finds_and_a_configured_count_sets(restore_threads):
    """auto with the native C layers on a 2-core CPU: torch's steps stay on one thread, the C kernels split their
    calls over both (said in the report's words); a configured count is every split's count; apply_threads sets
    both."""
    from draftsmith.kernels import native
    from draftsmith.serve_eval.engine.threads import apply_threads

    choice = choose_threads("auto", SMALL_MODEL_PARAMS - 1, "cpu", cores=2, native_rows=64)
    assert choice.count == 1 and choice.native_count == 2
    assert choice.describe() == "1 (2 from 65 tokens per step; native kernels on 2)"
    assert "their calls split over 2 cores" in choice.reason
    assert choose_threads("auto", SMALL_MODEL_PARAMS - 1, "cpu", cores=2).native_count == 1   # no native layers
    assert choose_threads("auto", SMALL_MODEL_PARAMS - 1, "cpu", cores=1, native_rows=64).native_count == 1
    assert choose_threads(3, 10, "cpu").native_count == 3
    before = native.threads()
    try:
        apply_threads(choice)
        assert torch.get_num_threads() == 1 and native.threads() == (2 if native.library() is not None else 1)
        apply_threads(choose_threads(1, 10, "cpu"))
        assert native.threads() == 1
    finally:
        native.set_threads(before)


def test_engine_sets_each_steps_count(tmp_path, restore_threads, monkeypatch):
    """The engine applies for_step to every step: a long prefill runs on both cores, the decode steps after it
    on one."""
    monkeypatch.setattr("draftsmith.serve_eval.engine.threads.available_cores", lambda: 2)
    model = make_llama(tmp_path / "m", max_pos=512)
    engine = LLMEngine(EngineConfig(str(model), num_gpu_blocks=64))
    assert torch.get_num_threads() == 1
    seen = []
    execute = engine.strategy.execute

    def recording(eng, out):
        seen.append((sum(out.num_scheduled_tokens), torch.get_num_threads()))
        return execute(eng, out)

    monkeypatch.setattr(engine.strategy, "execute", recording)
    wide = engine.threads.wide_from_tokens   # 257 where the native C layers serve the model, else 32
    assert wide == engine.executor.native_rows + 1 or wide == WIDE_STEP_TOKENS
    engine.add_request("long", [1 + i % 100 for i in range(wide + 8)], SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert seen == [(wide + 8, 2), (1, 1), (1, 1)]


def test_a_drafts_catch_up_forward_runs_at_its_own_rows_count_inside_a_one_thread_step(tmp_path, restore_threads,
                                                                                          monkeypatch):
    """A standalone draft's first proposal catches up on the whole prompt (wide + 8 tokens) inside a decode step of
    1 + K tokens: that forward runs on both cores, and the step's one thread is back for what follows (any draft
    forward after it, and the target's verify forward)."""
    from draftsmith.serve_eval.speculative.config import SpecConfig

    monkeypatch.setattr("draftsmith.serve_eval.engine.threads.available_cores", lambda: 2)
    target, draft = make_llama(tmp_path / "t", max_pos=512), make_llama(tmp_path / "d", layers=1, seed=1, max_pos=512)
    engine = LLMEngine(EngineConfig(str(target), num_gpu_blocks=64),
                       speculative=SpecConfig("standalone", draft_path=str(draft), num_speculative_tokens=2))
    proposer = engine.strategy.proposer
    seen = []
    forward = proposer.executor.forward
    monkeypatch.setattr(proposer.executor, "forward",
                        lambda ids, *a, **k: seen.append((ids.numel(), torch.get_num_threads())) or forward(ids, *a, **k))
    wide = engine.threads.wide_from_tokens
    engine.add_request("long", [1 + i % 100 for i in range(wide + 8)], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()   # the target's prefill (both cores)
    engine.step()   # the first round: catch-up on the prompt and the first token, then one draft step
    assert seen[0] == (wide + 9, 2)
    assert all(threads == 1 for _, threads in seen[1:]) and torch.get_num_threads() == 1


def test_a_block_drafts_injection_of_a_long_context_runs_on_both_cores(tmp_path, restore_threads, monkeypatch):
    """The block draft projects every target row since its last round into its KV in one forward (the whole prompt
    in the first round): that projection runs at its own rows' count, the block forward and the step after it on
    the step's one thread."""
    from draftsmith.serve_eval.speculative.config import SpecConfig
    from draftsmith.serve_eval.speculative.policy import SpecPolicyConfig

    monkeypatch.setattr("draftsmith.serve_eval.engine.threads.available_cores", lambda: 2)
    target = make_llama(tmp_path / "t", layers=4, max_pos=512)
    draft = feature_draft("block", target, tmp_path / "block", block_opts={"block_size": 5, "num_layers": 1})
    engine = LLMEngine(EngineConfig(str(target), num_gpu_blocks=64),
                       speculative=SpecConfig("block", draft_path=str(draft), num_speculative_tokens=4,
                                              policy=SpecPolicyConfig(fallback=False)))
    module = engine.strategy.proposer.draft
    injected, blocks = [], []
    inject, forward = module.injected_kv, module.forward
    monkeypatch.setattr(module, "injected_kv",
                        lambda ctx, *a: injected.append((ctx.shape[0], torch.get_num_threads())) or inject(ctx, *a))
    monkeypatch.setattr(module, "forward", lambda *a, **k: blocks.append(torch.get_num_threads()) or forward(*a, **k))
    wide = engine.threads.wide_from_tokens
    engine.add_request("long", [1 + i % 100 for i in range(wide + 8)], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()   # the target's prefill (both cores)
    engine.step()   # the first round: the prompt injected, then one block forward
    assert injected[0] == (wide + 8, 2)
    assert blocks and set(blocks) == {1} and torch.get_num_threads() == 1


def test_threads_for_sets_a_forwards_count_and_restores_the_previous_one(restore_threads):
    """Inside: the count for the forward's rows; after (an exception included): the count before; no choice (no
    engine attached): nothing changes."""
    choice = choose_threads("auto", SMALL_MODEL_PARAMS - 1, "cpu", cores=2)
    torch.set_num_threads(1)
    with threads_for(choice, 512):
        assert torch.get_num_threads() == 2
    assert torch.get_num_threads() == 1
    with pytest.raises(RuntimeError), threads_for(choice, 512):
        raise RuntimeError("the forward failed")
    assert torch.get_num_threads() == 1
    with threads_for(None, 512):
        assert torch.get_num_threads() == 1


def test_importing_draftsmith_before_torch_makes_openmp_workers_sleep_and_the_engine_warns_when_they_spin(
        monkeypatch, caplog, restore_threads):
    """draftsmith imported first sets OMP_WAIT_POLICY=PASSIVE (a user's value stands); torch imported first keeps
    OpenMP's spinning workers, and the engine says so once, when it may run multi-thread ops."""
    def policy(imports: str, env_value: str | None) -> str:
        env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        if env_value is not None:
            env["OMP_WAIT_POLICY"] = env_value
        code = f"{imports}; import os, draftsmith; print(os.environ.get('OMP_WAIT_POLICY'), draftsmith.OMP_PASSIVE)"
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              check=True).stdout.strip()

    assert policy("import draftsmith, torch", None) == "PASSIVE True"
    assert policy("import torch", None) == "None False"
    assert policy("import draftsmith", "ACTIVE") == "ACTIVE False"

    monkeypatch.setattr(draftsmith, "OMP_PASSIVE", False)
    monkeypatch.setattr(threads, "_warned_spinning_omp", False)
    with caplog.at_level(logging.WARNING, logger=threads.__name__):
        threads.apply_threads(choose_threads(1, 1000, "cpu"))        # never more than one thread: nothing to say
        assert "OMP_WAIT_POLICY" not in caplog.text
        for _ in range(2):
            threads.apply_threads(choose_threads("auto", 1000, "cpu", cores=2))
    assert caplog.text.count("OMP_WAIT_POLICY=PASSIVE") == 1
