"""Target families beyond Llama against transformers (fp32, <= 1e-4): Qwen3 dense (q/k norm), Qwen3-MoE (routed
experts, both router normalisations, dense layers by mlp_only_layers / decoder_sparse_step), Qwen2-MoE (shared
expert), and sliding-window attention (Mistral, Qwen2, Qwen3) with contexts longer than the window; prefill,
chunked prefill, decode and mixed steps, greedy LLM.generate, and the refusals at load."""

from __future__ import annotations

import pytest
import torch

from draftsmith.kernels.layers.family import layer_variants
from draftsmith.serve_eval.engine.model_executor import ModelExecutor
from test_executor import SCHEDULE, SHAPE, TOL, run_schedule_and_compare
from tiny_models import MOE, WINDOW, tiny_model

COMMON = dict(SHAPE, head_dim=16)  # the models' fields, for layer_variants over raw dicts
LONGEST = max(sum(step.get(name, 0) for step in SCHEDULE) for name in "ABC")  # 17 tokens for A
assert WINDOW < LONGEST  # the schedule's contexts outgrow the *-window families' window


FAMILIES = {
    "qwen3": ("qwen3", {}),
    "qwen3-tied": ("qwen3", {"tie_word_embeddings": True}),
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe-norm-topk": ("qwen3_moe", {"norm_topk_prob": True}),
    "qwen3_moe-dense-layers": ("qwen3_moe", {"mlp_only_layers": [0], "decoder_sparse_step": 2}),
    "qwen2_moe-shared": ("qwen2_moe", {}),
    "mistral-window": ("mistral-window", {}),
    "qwen2-window": ("qwen2-window", {}),
    "qwen3-window": ("qwen3-window", {}),
}
WORST: dict[str, float] = {}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_match_transformers_over_mixed_steps(tmp_path, name):
    """Prefill, chunked prefill, decode and mixed batches equal HF's full-sequence logits (from the saved dir:
    per-expert safetensors names are stacked at load)."""
    kind, extra = FAMILIES[name]
    model = tiny_model(kind, shape=SHAPE, **extra)
    model.save_pretrained(tmp_path)
    executor = ModelExecutor(tmp_path)
    worst = run_schedule_and_compare(model, executor)
    WORST[name] = worst
    print(f"{name}: max |dlogit| {worst:.2e}")
    assert worst < TOL
    from_memory = ModelExecutor.from_hf_model(model)  # transformers' in-memory (stacked) expert names
    assert run_schedule_and_compare(model, from_memory) < TOL


def test_variants_follow_the_config():
    """Which layers route to experts, slide, or norm q/k is read as transformers reads it."""
    moe = tiny_model("qwen3_moe", shape=SHAPE, mlp_only_layers=[0], decoder_sparse_step=2, num_hidden_layers=4).config
    assert [v.moe is not None for v in layer_variants(moe)] == [False, True, False, True]
    assert all(v.qk_norm for v in layer_variants(moe))
    qwen2 = tiny_model("qwen2", shape=SHAPE, use_sliding_window=True, sliding_window=5, max_window_layers=2).config
    assert [v.sliding_window for v in layer_variants(qwen2)] == [None, None, 5]
    off = tiny_model("qwen2", shape=SHAPE, use_sliding_window=False, sliding_window=5).config
    assert all(v.sliding_window is None for v in layer_variants(off))
    raw = dict(COMMON, model_type="qwen2", use_sliding_window=True, sliding_window=5, max_window_layers=1)
    assert [v.sliding_window for v in layer_variants(raw)] == [None, 5, 5]  # a hub config without layer_types


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe", "mistral-window"])
def test_greedy_generate_equals_transformers(tmp_path, name):
    """LLM.generate (paged cache, chunked prefill, batch of 2) == transformers' greedy generate, token for token."""
    from draftsmith.serve_eval.engine import LLM, SamplingParams

    kind, extra = FAMILIES[name]
    model = tiny_model(kind, shape=SHAPE, **extra)
    model.generation_config.eos_token_id = None
    model.save_pretrained(tmp_path)
    prompts = [[5, 17, 33, 2, 9, 70, 11], [101, 4, 4, 8]]
    llm = LLM(str(tmp_path), block_size=4, prefill_chunk_size=4, num_gpu_blocks=64)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=14, do_sample=False, min_new_tokens=14)
        assert out.output_token_ids == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize("field,extra,kind", [
    ("model_type", {}, "gpt2"),
    ("layer_types", {"layer_types": ["full_attention", "chunked_attention", "full_attention"]}, "qwen3"),
    ("num_experts_per_tok", {"num_experts_per_tok": 9}, "qwen3_moe"),
])
def test_unsupported_fields_are_refused_by_name(field, extra, kind):
    d = {**COMMON, "model_type": kind, **(MOE if kind.endswith("moe") else {}), **extra}
    with pytest.raises(ValueError, match=field):
        layer_variants(d)
