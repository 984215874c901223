"""`draftsmith plan` reproduces the seed's worked examples (chapter 18) within the seed's rounding."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from draftsmith.serve_eval.plan.cli import main
from draftsmith.serve_eval.plan.estimate import DraftOptions, Hardware, TargetSpec, Workload, make_plan

GB = 1e9


def llama3_70b(params: float = 70e9) -> TargetSpec:
    return TargetSpec(params=params, num_layers=80, num_kv_heads=8, head_dim=128, hidden_size=8192,
                      vocab_size=128256, intermediate_size=28672, num_heads=64)


def llama_7b() -> TargetSpec:
    return TargetSpec(params=7e9, num_layers=32, num_kv_heads=8, head_dim=128, hidden_size=4096, vocab_size=32000)


def row(plan, name):
    return next(r for r in plan.strategies if r.strategy == name)


def test_70b_on_one_h100_speculative_sampling_example():
    """18.1.1 worked example: 140 GB -> ~42 ms/step, 7B draft ~4.2 ms/step, K=5 alpha=0.75 -> 4.75 tokens,
    63 ms/round, ~13 ms/token, ~3.2x -- all from bytes / bandwidth, no step-time overrides."""
    plan = make_plan(llama3_70b(), Hardware(80, 3.35, tp=1), Workload(),
                     DraftOptions(K=5, standalone_params=7e9, alpha={"standalone": 0.75, "eagle": 0.72, "medusa": 0.5}))
    assert plan.weights_gb_total == pytest.approx(140)
    assert plan.target_step_ms == pytest.approx(42, abs=0.5)
    sa = row(plan, "standalone")
    assert sa.draft_cost_ms / 5 == pytest.approx(4.2, abs=0.05)
    assert sa.draft_cost_ms == pytest.approx(21, abs=0.25)
    assert sa.tokens_per_call == pytest.approx(4.75)
    assert sa.draft_cost_ms + plan.target_step_ms == pytest.approx(63, abs=0.5)
    assert sa.ms_per_token == pytest.approx(13, abs=0.5)
    assert sa.speedup == pytest.approx(3.2, abs=0.05)
    assert row(plan, "no-spec").ms_per_token == pytest.approx(plan.target_step_ms)


def test_70b_on_two_h100s_strategy_table():
    """18.1.2 table with the seed's step costs (42 ms target, 4 ms standalone, 0.5 ms EAGLE, ~0 Medusa) and
    its acceptance defaults (0.80 / 0.72 / 0.50): tokens/call 5.0/4.6/3.5, ms/token 42/12.4/9.7/12.0."""
    plan = make_plan(llama3_70b(), Hardware(80, 3.35, tp=2), Workload(batch=1, context_len=2048),
                     DraftOptions(K=5, standalone_params=7e9, target_step_ms=42, standalone_step_ms=4,
                                  eagle_step_ms=0.5, medusa_round_ms=0))
    expect = {"no-spec": (1.0, 42.0), "standalone": (5.0, 12.4), "eagle": (4.6, 9.7), "medusa": (3.5, 12.0)}
    for name, (tokens, ms) in expect.items():
        r = row(plan, name)
        assert r.tokens_per_call == pytest.approx(tokens)
        assert round(r.ms_per_token, 1) == ms, name
    assert row(plan, "standalone").draft_cost_ms == pytest.approx(20)
    assert row(plan, "eagle").draft_cost_ms == pytest.approx(2.5)
    seed_rows = [r for r in plan.strategies if r.strategy != "block"]  # the seed's table has no block draft
    best = min(seed_rows, key=lambda r: r.ms_per_token)
    assert best.strategy == "eagle"  # "EAGLE wins on effective ms/token in this configuration"


def test_70b_on_two_h100s_memory_budget():
    """18.1.2 memory budget: 70 GB weights per GPU; KV at batch 1 x 2048 tokens by the seed's formula
    (1*2048*80*8*128*2*2 bytes); ~9 GB left per GPU; a sharded 7B draft takes 7 GB/GPU leaving ~2 GB;
    batch 16 needs ~10 GB of KV, leaving ~10 GB of the 160 GB spare."""
    plan = make_plan(llama3_70b(), Hardware(80, 3.35, tp=2), Workload(batch=1, context_len=2048),
                     DraftOptions(K=5, standalone_params=7e9))
    assert plan.weights_gb_per_gpu == pytest.approx(70)
    kv_total = plan.kv.bytes_for_batch * 2  # KV heads split over the two GPUs
    assert kv_total == 1 * 2048 * 80 * 8 * 128 * 2 * 2
    assert row(plan, "no-spec").free_gb_per_gpu == pytest.approx(9, abs=1)
    sa = row(plan, "standalone")
    assert sa.draft_gb_per_gpu == pytest.approx(7)
    assert sa.free_gb_per_gpu == pytest.approx(2, abs=1) and sa.fits
    batch16 = make_plan(llama3_70b(), Hardware(80, 3.35, tp=2), Workload(batch=16, context_len=2048), DraftOptions())
    kv16_gb = batch16.kv.bytes_for_batch * 2 / GB
    assert kv16_gb == pytest.approx(10, abs=1)
    assert 160 - 140 - kv16_gb == pytest.approx(10, abs=1)


def test_7b_paged_kv_blocks_example():
    """18.2.2 worked example: 2,097,152 B/block (~2.1 MB); ~28,500 blocks and ~456,000 slots in 60 GB;
    128 blocks/seq preallocated -> ~222 seqs; 16 blocks at 256 tokens -> ~1,781 seqs, 87.5% waste;
    a 512-token prefix shared by 100 seqs: 32 vs 3,200 blocks, 3,168 saved ~ 6.6 GB."""
    plan = make_plan(llama_7b(), Hardware(80, 3.35), Workload(batch=100, context_len=2048, block_size=16,
                     avg_len=256, shared_prefix_tokens=512, shared_prefix_seqs=100, kv_budget_gb=60), DraftOptions())
    kv = plan.kv
    assert plan.weights_gb_total == pytest.approx(14)
    assert kv.bytes_per_block == 2 * 16 * 32 * 8 * 128 * 2 == 2_097_152
    # The seed divides by the rounded 2.1 MB; the exact count is 0.4% higher.
    assert kv.num_blocks == pytest.approx(28_500, rel=0.01)
    assert kv.token_slots == pytest.approx(456_000, rel=0.01)
    assert kv.blocks_per_seq == 128
    assert kv.max_seqs_preallocated == pytest.approx(222, rel=0.01)
    assert kv.blocks_per_avg_seq == 16
    assert kv.max_seqs_paged == pytest.approx(1_781, rel=0.01)
    assert kv.internal_fragmentation == pytest.approx(112 / 128)
    assert (kv.prefix_blocks, kv.prefix_blocks_without_sharing, kv.prefix_blocks_saved) == (32, 3_200, 3_168)
    assert kv.prefix_gb_saved == pytest.approx(6.6, abs=0.05)
    # The 1,000-token system prompt: 131 MB of KV per request.
    assert 1000 * kv.bytes_per_token == 1000 * 32 * 8 * 128 * 2 * 2 == 131_072_000


def test_hf_config_is_read_and_params_estimated(tmp_path):
    """A Llama-3-70B config.json gives its shapes and ~70.6B params (embeddings + lm_head + 80 layers)."""
    cfg = {"hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
           "vocab_size": 128256, "intermediate_size": 28672, "torch_dtype": "bfloat16", "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = TargetSpec.from_hf_config(tmp_path)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype_bytes) == (80, 8, 128, 2)
    assert spec.params == pytest.approx(70.55e9, rel=0.01)
    assert TargetSpec.from_hf_config(tmp_path / "config.json", params=70e9).params == 70e9


def test_bad_inputs_name_the_field(tmp_path):
    """Missing config keys, a missing file and non-positive hardware numbers raise ValueError naming them."""
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(ValueError, match="num_hidden_layers"):
        TargetSpec.from_hf_config(tmp_path)
    with pytest.raises(ValueError, match="no config.json"):
        TargetSpec.from_hf_config(tmp_path / "nope")
    with pytest.raises(ValueError, match="gpu_mem_gb"):
        Hardware(gpu_mem_gb=0)
    with pytest.raises(ValueError, match="tp"):
        Hardware(tp=0)
    with pytest.raises(ValueError, match=r"alpha\[eagle\]"):
        DraftOptions(alpha={"standalone": 0.8, "eagle": 1.5, "medusa": 0.5})


@settings(max_examples=60, deadline=None)
@given(alpha=st.floats(0, 1), K=st.integers(1, 8), target_ms=st.floats(1, 100),
       draft_ms=st.floats(0, 20), eagle_ms=st.floats(0, 5), medusa_ms=st.floats(0, 5))
def test_ms_per_token_is_the_seed_formula(alpha, K, target_ms, draft_ms, eagle_ms, medusa_ms):
    """For any alpha, K and step costs: ms/token = (target step + draft cost per round) / (1 + K*alpha)."""
    plan = make_plan(llama_7b(), Hardware(), Workload(), DraftOptions(
        K=K, standalone_params=1e9, alpha={"standalone": alpha, "eagle": alpha, "medusa": alpha},
        target_step_ms=target_ms, standalone_step_ms=draft_ms, eagle_step_ms=eagle_ms, medusa_round_ms=medusa_ms))
    for name, round_ms in (("standalone", K * draft_ms), ("eagle", K * eagle_ms), ("medusa", medusa_ms)):
        r = row(plan, name)
        assert r.ms_per_token == pytest.approx((target_ms + round_ms) / (1 + K * alpha), rel=1e-9)
        assert r.speedup == pytest.approx(target_ms / r.ms_per_token, rel=1e-9)


def test_cli_json_and_errors(capsys):
    """The CLI prints a JSON plan, names missing target numbers, and --help works."""
    argv = ["--params", "7e9", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--hidden", "4096",
            "--vocab", "32000", "--kv-budget-gb", "60", "--standalone-params", "1e9", "--json"]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["kv"]["bytes_per_block"] == 2_097_152
    assert [s["strategy"] for s in plan["strategies"]] == ["no-spec", "standalone", "eagle", "medusa", "block"]
    assert main(["--params", "7e9"]) == 2
    assert "--layers" in capsys.readouterr().err
    assert main(argv[:-1]) == 0  # rich tables
    assert "Draft strategies" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
