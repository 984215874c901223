"""The engine's intra-op thread count: the rule, and that the engine applies, logs and reports its choice."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from serve_eval.engine import EngineConfig, LLMEngine
from serve_eval.engine.threads import SMALL_MODEL_PARAMS, choose_threads, estimate_num_params
from spec_helpers import make_llama


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
    with caplog.at_level(logging.INFO, logger="serve_eval.engine.threads"):
        engine = LLMEngine(EngineConfig(str(model), num_gpu_blocks=64, num_threads=setting))
    assert torch.get_num_threads() == expected
    assert engine.num_threads == expected and engine.stats().num_threads == expected
    assert f"engine: {expected} intra-op thread(s) (num_threads={setting}" in caplog.text
