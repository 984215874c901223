"""Export of a quantized draft in compressed-tensors' pack-quantized layout, read back two ways:
our reader (drafts.quant_export.read_compressed) and transformers + compressed-tensors (vLLM's loader library)."""

from __future__ import annotations

import json

import pytest
import torch

from draftsmith.drafts.identity import target_fingerprint
from draftsmith.drafts.io import load_draft, save_draft
from draftsmith.drafts.quant_export import pack_int32, read_compressed, unpack_int32
from draftsmith.drafts.quantize_job import main as quantize_main
from draftsmith.drafts.standalone import StandaloneDraft
from draftsmith.kernels.quant import QuantizedLinear
from spec_helpers import make_llama


@pytest.mark.parametrize("bits", [8, 4])
def test_int32_packing_round_trips_and_matches_compressed_tensors(bits):
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    q = torch.randint(lo, hi + 1, (5, 64), dtype=torch.int8)
    packed = pack_int32(q, bits)
    assert packed.dtype == torch.int32 and packed.shape == (5, 64 * bits // 32)
    assert torch.equal(unpack_int32(packed, bits, 64), q)
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    assert torch.equal(helpers.pack_to_int32(q, bits), packed)


@pytest.mark.parametrize("args", [["--bits", "8"], ["--bits", "4", "--group-size", "32", "--quantize-head"]],
                         ids=["int8", "int4"])
def test_export_round_trip(tmp_path, capsys, args):
    target = make_llama(tmp_path / "target", hidden=64, layers=2)
    torch.manual_seed(0)
    src = save_draft(StandaloneDraft.from_target_config(target, num_layers=1), tmp_path / "draft", "standalone",
                     target_fingerprint(target))
    assert quantize_main([str(src), *args, "--out", str(tmp_path / "q"), "--export", str(tmp_path / "export")]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["quantized_bytes"] < summary["bf16_bytes"]
    quantized = load_draft(tmp_path / "q").model
    expected = {f"{n}.weight": m.weight.float() for n, m in quantized.named_modules() if isinstance(m, QuantizedLinear)}
    ours = read_compressed(tmp_path / "export")
    for name, weight in expected.items():
        assert torch.equal(ours[name], weight), name
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["quantization_config"]["format"] == "pack-quantized"
    assert ("lm_head" in config["quantization_config"]["ignore"]) == ("--quantize-head" not in args)

    pytest.importorskip("compressed_tensors")
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the library's dequantized weights compute what our quantized draft computes
        assert torch.allclose(hf(ids).logits, quantized.forward_batch(ids), atol=1e-4)
    for name, weight in expected.items():
        hf_weight = hf.get_submodule(name.removesuffix(".weight")).weight
        assert torch.allclose(hf_weight.float(), weight, atol=1e-6), name
