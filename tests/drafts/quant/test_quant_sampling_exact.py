"""Sampling exactness at T = 1 with a QUANTIZED draft: the standalone proposer running an INT8 draft on
torch's int8 kernel (bf16 activations) samples its drafts from the quantized model's rows, and the engine's
output law stays the target's.

Design, helpers and thresholds are tests/test_spec_sampling_exact.py's (the joint of the 2nd and 3rd
generated tokens against the exact enumeration, chi-square at ALPHA 0.001 with power >= 0.9 against any
TV-0.02 error, and the TV-0.03 negative control); only the draft differs. INT8 because the target is 16 wide
(int4 groups are >= 32).
"""

from __future__ import annotations


from draftsmith.drafts.quant import QuantConfig
from draftsmith.drafts.quantize_job import quantize_dir
from draftsmith.serve_eval.engine import EngineConfig, LLMEngine
from draftsmith.serve_eval.speculative.config import SpecConfig
from draftsmith.serve_eval.speculative.policy import SpecPolicyConfig
from spec_helpers import make_llama, noisy_copy
from stats_helpers import chi_square_fit, total_variation, worst_case_perturbation
from test_spec_sampling_exact import (
    ALPHA, BLOCK_SIZE, CONTROL_TV, K, MIN_POWER, SETTINGS, TV, V, WAVE, exact_pair_joint, pair_counts, sample_pairs)

SETTING = "T1.0-top_p0.8"


def test_int8_standalone_draft_keeps_the_target_joint_at_t1(tmp_path):
    target = make_llama(tmp_path / "target", vocab=V, hidden=16, layers=1, seed=0, init=0.6)
    draft = noisy_copy(target, tmp_path / "draft", noise=0.06, seed=3)
    quantized, _ = quantize_dir(draft, QuantConfig(8), tmp_path / "draft-int8")
    spec = SpecConfig("standalone", draft_path=str(quantized), num_speculative_tokens=K, draft_dtype="bfloat16",
                      policy=SpecPolicyConfig(fallback=False))
    temperature, top_p, n = SETTINGS[SETTING]
    cfg = EngineConfig(str(target), block_size=BLOCK_SIZE, max_model_len=BLOCK_SIZE, num_gpu_blocks=WAVE + 16,
                       num_cpu_blocks=16, max_num_seqs=WAVE, max_num_batched_tokens=16 * WAVE,
                       enable_prefix_caching=False)
    engine = LLMEngine(cfg, speculative=spec)
    executor = engine.strategy.proposer.executor
    mlp = executor.model.model.layers[0].serving_ops.mlp  # partial(swiglu, gate_up, down)
    assert {linear.mode for linear in mlp.args} == {"int8-kernel"}, "the draft must run on the int8 kernel"
    pairs = sample_pairs(engine, {SETTING: (temperature, top_p, n)})[SETTING]
    total = engine.stats().spec.total
    a1, a2 = total.acceptance_by_position
    assert min(1 - a1, a1 - a2, a2) > 0.05, total.acceptance_by_position  # every accept/reject path taken
    exact = exact_pair_joint(target, temperature, top_p)
    counts = pair_counts(pairs)
    fit = chi_square_fit(counts, exact, ALPHA, TV)
    assert fit.power >= MIN_POWER, f"design: power {fit.power:.3f} (df {fit.df}) against TV {TV}"
    assert fit.p_value > ALPHA, (f"(x2, x3) differ from the target: p = {fit.p_value:.2e} (df {fit.df}); "
                                 f"empirical TV {total_variation(counts / counts.sum(), exact):.4f}")
    moved = worst_case_perturbation(exact, CONTROL_TV)
    assert chi_square_fit(counts, moved, ALPHA, CONTROL_TV).p_value < ALPHA, "negative control not rejected"
