"""Weight-only INT8 / INT4 drafts (kernels.quant, drafts.quant): error bounds, bad input, serving, export."""

from __future__ import annotations


import pytest
import torch

from draftsmith.drafts.identity import target_fingerprint
from draftsmith.drafts.io import load_draft, save_draft
from draftsmith.drafts.quant import QuantConfig
from draftsmith.drafts.quantize_job import quantize_dir
from draftsmith.drafts.standalone import StandaloneDraft
from draftsmith.kernels.quant import QuantizedLinear, QuantScheme, QuantServingLinear, dequantize, quantize_weight
from draftsmith.serve_eval.engine import EngineConfig, LLMEngine, SamplingParams
from draftsmith.serve_eval.speculative.config import SpecConfig
from spec_helpers import feature_draft, make_llama, run_engine, workload

KINDS = ("standalone", "medusa", "eagle", "eagle3")
INT8, INT4 = QuantConfig(8), QuantConfig(4, 32, quantize_head=True)


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    """A tiny target (hidden 64) and one untrained draft dir of each kind."""
    root = tmp_path_factory.mktemp("quant")
    target = make_llama(root / "target", hidden=64, layers=2)
    dirs = {}
    torch.manual_seed(0)
    standalone = StandaloneDraft.from_target_config(target, num_layers=1)
    dirs["standalone"] = save_draft(standalone, root / "standalone", "standalone", target_fingerprint(target))
    for kind in KINDS[1:]:
        dirs[kind] = feature_draft(kind, target, root / kind, init=_spread)
    return target, dirs


def _spread(draft) -> None:
    """Random weights (Medusa's residual blocks start at zero: nothing to quantize there)."""
    with torch.no_grad():
        for module in draft.modules():
            if isinstance(module, torch.nn.Linear) and module.weight.requires_grad:
                module.weight.normal_(0, 0.1)


# ------------------------------------------------------------------------------------- quantize math


@pytest.mark.parametrize("scheme", [QuantScheme(8), QuantScheme(4, 32), QuantScheme(4, 64)])
def test_dequantized_weight_is_within_half_a_step_of_the_original(scheme):
    w = torch.randn(48, 128) * torch.rand(48, 1) * 3  # rows of very different ranges
    q, scales = quantize_weight(w, scheme)
    back = dequantize(q, scales, scheme.bits)
    step = scales[:, None] if scheme.bits == 8 else scales.repeat_interleave(scheme.group_size, dim=1)
    assert ((back - w).abs() <= step / 2 + 1e-6).all()
    assert q.dtype == (torch.int8 if scheme.bits == 8 else torch.uint8)
    assert q.numel() * q.element_size() == w.numel() * scheme.bits // 8


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("config", [INT8, INT4], ids=["int8", "int4"])
def test_every_quantized_layer_of_a_draft_is_within_its_bound(drafts, tmp_path, kind, config):
    """Per layer: elementwise error <= half a quantization step, relative error ~ what the bit width allows;
    the int-kernel serving linear computes what the dequantized weight does (bf16 rounding aside)."""
    _, dirs = drafts
    dense = load_draft(dirs[kind]).model.state_dict()
    out, _ = quantize_dir(dirs[kind], config, tmp_path / kind)
    model = load_draft(out).model
    layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert layers
    for name, layer in layers.items():
        w = dense[f"{name}.weight"]
        err = (layer.weight - w).abs()
        step = layer.scales[:, None] if config.bits == 8 else layer.scales.repeat_interleave(32, dim=1)
        assert (err <= step / 2 + 1e-6).all(), name
        assert err.norm() / w.norm() < (0.01 if config.bits == 8 else 0.12), name
        serving = QuantServingLinear(layer.qweight, layer.scales.bfloat16(), None, layer.scheme)
        assert serving.mode == f"int{config.bits}-kernel"
        x = torch.randn(3, layer.in_features).bfloat16()
        ref = x.float() @ layer.weight.bfloat16().float().T
        assert torch.allclose(serving(x).float(), ref, atol=0.05 * ref.abs().max().item()), name


def test_heads_follow_the_rule(drafts, tmp_path):
    """The target's head (EAGLE-1, Medusa shared) stays dense; a draft's own head only with quantize_head."""
    _, dirs = drafts
    for kind, head_stays in (("eagle", True), ("eagle3", False), ("standalone", False)):
        for quantize_head in (False, True):
            out, _ = quantize_dir(dirs[kind], QuantConfig(8, quantize_head=quantize_head), tmp_path / f"{kind}{quantize_head}")
            head = load_draft(out).model.lm_head
            assert isinstance(head, QuantizedLinear) == (quantize_head and not head_stays), (kind, quantize_head)


def test_fallback_dequantizes_once_and_says_so():
    layer = QuantizedLinear.from_linear(torch.nn.Linear(64, 16), QuantScheme(8))
    with pytest.warns(UserWarning, match="dequantized at load"):
        QuantServingLinear._warned.clear()
        serving = QuantServingLinear(layer.qweight, layer.scales.float(), layer.bias, layer.scheme)
    assert serving.mode == "dequantized"
    x = torch.randn(2, 64)
    assert torch.allclose(serving(x), layer(x), atol=1e-6)


# ---------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("kwargs, message", [
    (dict(bits=3), r"quant.bits: 3 is not supported; allowed values: \[8, 4\]"),
    (dict(bits=4, group_size=48), r"quant.group_size: 48 is not supported for int4; allowed values: \[32, 64, 128, 256\]"),
])
def test_unsupported_bits_or_group_size_is_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message):
        QuantConfig(**kwargs)


def test_group_size_must_divide_every_layer(drafts, tmp_path):
    _, dirs = drafts
    with pytest.raises(ValueError, match=r"quant.group_size: 128 does not divide the input width 64 of "
                                         r"model.layers.0.self_attn.q_proj; allowed values for this draft: \[32, 64\]"):
        quantize_dir(dirs["standalone"], QuantConfig(4, 128), tmp_path / "bad")


def test_quantized_draft_is_refused_by_training(drafts, tmp_path):
    from draftsmith.train.distill.run import warm_start

    target, dirs = drafts
    out, _ = quantize_dir(dirs["eagle"], INT8, tmp_path / "q")
    fresh = load_draft(dirs["eagle"]).model
    with pytest.raises(ValueError, match=r"draft.init_from: .* is a quantized draft; training takes an unquantized"):
        warm_start(fresh, "eagle", str(out), target)
    model = load_draft(out).model
    x = torch.randn(2, 128, requires_grad=True)
    with pytest.raises(ValueError, match="a quantized draft cannot be trained"):
        model.fc(x)


# ------------------------------------------------------------------------------------------ serving


@pytest.mark.parametrize("kind", KINDS)
def test_quantized_draft_speculates_with_greedy_output_identical_to_no_spec(drafts, tmp_path, kind):
    target, dirs = drafts
    out, summary = quantize_dir(dirs[kind], INT4, tmp_path / kind)
    assert summary["quantized_bytes"] < summary["bf16_bytes"]
    prompts, lengths = workload(4, seed=1, max_out=20)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    plain = run_engine(LLMEngine(EngineConfig(str(target), num_gpu_blocks=64)), prompts, params)
    spec = SpecConfig(kind, draft_path=str(out), num_speculative_tokens=3, draft_dtype="bfloat16")
    engine = LLMEngine(EngineConfig(str(target), num_gpu_blocks=64), speculative=spec)
    got = run_engine(engine, prompts, params)
    assert {r: o.output_token_ids for r, o in got.items()} == {r: o.output_token_ids for r, o in plain.items()}
    assert engine.stats().spec.total.num_rounds > 0
    if kind == "standalone":  # the draft executor's weight accounting is the quantized size
        dense = LLMEngine(EngineConfig(str(target), num_gpu_blocks=64), speculative=SpecConfig(
            kind, draft_path=str(dirs[kind]), num_speculative_tokens=3, draft_dtype="bfloat16"))
        quantized_bytes = engine.strategy.proposer.executor.weight_bytes()
        assert quantized_bytes < 0.6 * dense.strategy.proposer.executor.weight_bytes()


def test_quantized_block_draft_keeps_the_target_head_and_greedy_output(tmp_path):
    """The block-parallel draft (a kind added later): its frozen head is the target's and stays dense."""
    from draftsmith.kernels.layers.checkpoint import load_target_embed_and_head

    target = make_llama(tmp_path / "target", layers=4, seed=0)
    init = lambda d: (_spread(d), d.init_from_target(*load_target_embed_and_head(target)))  # noqa: E731
    draft = feature_draft("block", target, tmp_path / "block", init=init, block_opts={"block_size": 9})
    out, _ = quantize_dir(draft, QuantConfig(4, 32, quantize_head=True), tmp_path / "block-int4")
    model = load_draft(out).model
    assert not isinstance(model.lm_head, QuantizedLinear) and isinstance(model.fc, QuantizedLinear)
    prompts, lengths = workload(3, seed=2, max_out=16)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    engine_cfg = dict(block_size=4, max_model_len=96, prefill_chunk_size=16, max_num_batched_tokens=96,
                      num_gpu_blocks=200)
    plain = run_engine(LLMEngine(EngineConfig(str(target), **engine_cfg)), prompts, params)
    spec = SpecConfig("block", draft_path=str(out), num_speculative_tokens=4, draft_dtype="bfloat16")
    got = run_engine(LLMEngine(EngineConfig(str(target), **engine_cfg), speculative=spec), prompts, params)
    assert {r: o.output_token_ids for r, o in got.items()} == {r: o.output_token_ids for r, o in plain.items()}


def test_quantize_job_reports_bad_input_in_one_line(drafts, capsys):
    from draftsmith.drafts.quantize_job import main

    _, dirs = drafts
    assert main([str(dirs["eagle"]), "--bits", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "draftsmith quantize: error: quant.bits: 3 is not supported; allowed values: [8, 4]"


def test_quantized_medusa_proposes_the_quantized_heads_argmax(drafts, tmp_path):
    """The proposer casts features to the draft's dtype (its first parameter's): a quantized module must
    present a float dtype there, not uint8 / int8 (regression: INT4 Medusa proposed garbage, alpha 0)."""
    from draftsmith.serve_eval.speculative.proposers.base import TargetFeatures
    from draftsmith.serve_eval.speculative.proposers.medusa import MedusaProposer
    from spec_helpers import Seq, params

    _, dirs = drafts
    out, _ = quantize_dir(dirs["medusa"], INT4, tmp_path / "m4")
    model = load_draft(out, dtype=torch.bfloat16).model
    assert all(next(m.parameters()).is_floating_point() for m in model.modules() if isinstance(m, QuantizedLinear))
    hidden = torch.randn(2, 64)
    with torch.no_grad():
        expected = model(hidden[-1:].bfloat16()).float().argmax(-1)[0]  # [heads]
    proposer = MedusaProposer.from_draft(model)
    proposer.add_features("r", TargetFeatures(0, hidden, None))
    proposal = proposer.propose([Seq("r", [1, 2, 3], params())], [4])[0]
    assert proposal.tokens.tolist() == expected[:4].tolist()
