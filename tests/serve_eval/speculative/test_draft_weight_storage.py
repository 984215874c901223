"""A draft's weights in fp16 panels (SpecConfig.draft_weight_storage): the draft's serving form stores them so, the
target's does not. (Exactness under the default fp16 storage is the greedy and sampling suites' business: they run
every draft kind with it.)"""
from __future__ import annotations

import pytest

from draftsmith.kernels import small_gemm
from draftsmith.serve_eval.engine import EngineConfig, LLMEngine
from draftsmith.serve_eval.speculative.config import SpecConfig
from spec_helpers import make_llama

pytestmark = pytest.mark.skipif(not small_gemm.available(), reason="no native CPU kernels here")


@pytest.mark.parametrize("storage,half", [("float16", True), ("float32", False)])
def test_the_draft_stores_its_panels_as_asked_and_the_target_keeps_fp32(tmp_path, storage, half):
    target, draft = make_llama(tmp_path / "target", seed=0), make_llama(tmp_path / "draft", seed=7, layers=1)
    spec = SpecConfig("standalone", draft_path=str(draft), draft_weight_storage=storage)
    eng = LLMEngine(EngineConfig(str(target), block_size=4, max_model_len=64, num_gpu_blocks=64), speculative=spec)
    draft_model, target_model = eng.strategy.proposer.executor.model, eng.executor.model
    assert draft_model.serving_head.small.half == half
    assert all(layer.qkv.half == half for layer in draft_model.native_stack.layers)
    assert not target_model.serving_head.small.half
    assert not any(layer.qkv.half for layer in target_model.native_stack.layers)
