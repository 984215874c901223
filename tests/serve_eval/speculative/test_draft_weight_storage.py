"""A draft's weights in fp16 panels (SpecConfig.draft_weight_storage): the draft's serving form stores them so, the
target's does not. (Exactness under the default fp16 storage is the greedy and sampling suites' business: they run
every draft kind with it.)"""
from __future__ import annotations

import pytest

from draftsmith.kernels import small_gemm
from draftsmith.serve_eval.engine import EngineConfig, LLMEngine
from draftsmith.serve_eval.speculative.config import SpecConfig
from spec_helpers import feature_draft, make_llama

pytestmark = pytest.mark.skipif(not small_gemm.available(), reason="no native CPU kernels here")
ENGINE = dict(block_size=4, max_model_len=64, num_gpu_blocks=64)


def native_halves(model) -> set[bool]:
    """The panel format of every native layer of a serving model ({} where the native layer is off)."""
    return {layer.serving_ops.native.qkv.half for layer in model.layers if layer.serving_ops.native is not None}


@pytest.mark.parametrize("storage,half", [("float16", True), ("float32", False)])
def test_the_standalone_draft_stores_its_panels_as_asked_and_the_target_keeps_fp32(tmp_path, storage, half):
    target, draft = make_llama(tmp_path / "target", seed=0), make_llama(tmp_path / "draft", seed=7, layers=1)
    spec = SpecConfig("standalone", draft_path=str(draft), draft_weight_storage=storage)
    eng = LLMEngine(EngineConfig(str(target), **ENGINE), speculative=spec)
    draft_model, target_model = eng.strategy.proposer.executor.model, eng.executor.model
    assert draft_model.serving_head.small.half == half
    assert native_halves(draft_model.model) <= {half}
    assert not target_model.serving_head.small.half and native_halves(target_model.model) <= {False}


@pytest.mark.parametrize("storage,half", [("float16", True), ("float32", False)])
def test_a_feature_draft_stores_its_panels_as_asked(tmp_path, storage, half):
    target = make_llama(tmp_path / "target", seed=0)
    draft = feature_draft("eagle", target, tmp_path / "eagle")
    eng = LLMEngine(EngineConfig(str(target), **ENGINE),
                    speculative=SpecConfig("eagle", draft_path=str(draft), draft_weight_storage=storage))
    eagle = eng.strategy.proposer.draft
    assert eagle.serving_head.small.half == half and native_halves(eagle) <= {half}
    assert not eng.executor.model.serving_head.small.half
