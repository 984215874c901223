"""The serving Linear and decoder layer: fp32 on CPU keeps the weight transposed ([in, out] row-major) without a
second copy, a tied head keeps the embedding as it was, and a layer that emits only some rows emits exactly
those rows of the full output."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.drafts.common import causal_attn_fn
from draftsmith.kernels.layers.causal_lm import CausalLM, LMShape
from draftsmith.kernels.layers.config import DecoderConfig
from draftsmith.kernels.layers.decoder import DecoderLayer
from draftsmith.kernels.layers.linear import Linear
from draftsmith.kernels.layers.rope import RotaryEmbedding

DECODER = DecoderConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 9, 33])
def test_fused_transposed_linear_matches_f_linear_and_aliases_the_modules(bias, rows):
    torch.manual_seed(0)
    mods = [nn.Linear(32, n, bias=bias) for n in (32, 16, 16)]
    ref_w = torch.cat([m.weight.detach().clone() for m in mods])
    ref_b = torch.cat([m.bias.detach().clone() for m in mods]) if bias else None
    fused = Linear.fuse(mods)
    assert fused.weight_t is not None and fused.weight_t.is_contiguous() and fused.weight_t.shape == (32, 64)
    x = torch.randn(rows, 32)
    torch.testing.assert_close(fused(x), F.linear(x, ref_w, ref_b), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused(x.view(1, rows, 32)), F.linear(x, ref_w, ref_b)[None], atol=1e-5, rtol=1e-5)
    storage = fused.weight_t.untyped_storage().data_ptr()
    for mod, start in zip(mods, (0, 32, 48)):  # one copy: the modules read the fused matrix
        assert mod.weight.untyped_storage().data_ptr() == storage
        torch.testing.assert_close(mod.weight, ref_w[start:start + mod.out_features], atol=0, rtol=0)


def test_tied_head_leaves_the_embedding_contiguous_and_shared():
    shape = LMShape(vocab_size=64, num_layers=1, decoder=DECODER, tie_word_embeddings=True)
    model = CausalLM(shape).eval()
    before = model.model.embed_tokens.weight.detach().clone()
    model.to_serving_()
    embed = model.model.embed_tokens.weight
    assert model.tied and embed.is_contiguous()
    torch.testing.assert_close(embed.detach(), before, atol=0, rtol=0)
    hidden = torch.randn(3, 32)
    torch.testing.assert_close(model.compute_logits(hidden), hidden @ before.t(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("serving", [False, True])
def test_out_rows_emit_exactly_those_rows(serving):
    torch.manual_seed(1)
    layer = DecoderLayer(DECODER).eval()
    if serving:
        layer.to_serving_()
    rotary = RotaryEmbedding(DECODER)
    hidden = torch.randn(9, 32)
    cos, sin = rotary(torch.arange(9), hidden.dtype)
    attn = causal_attn_fn(1, 9)
    with torch.no_grad():
        full = layer(hidden, cos, sin, attn)
        for rows in (slice(1, 5), torch.tensor([0, 3, 8])):
            torch.testing.assert_close(layer(hidden, cos, sin, attn, out_rows=rows), full[rows], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("shape", [(1, 256), (5, 256), (64, 96), (3, 4, 16)])
def test_serving_norm_is_bit_identical_to_hf_and_to_the_training_norm(shape):
    """The fp32 serving RMSNorm spells the math out with fewer dispatches; it must not move a single bit
    (greedy exactness compares its outputs with the training form's and HF's)."""
    from draftsmith.kernels.layers.norm import RMSNorm

    torch.manual_seed(2)
    norm = RMSNorm(shape[-1], eps=1e-5)
    norm.weight.data = torch.randn(shape[-1])
    x = torch.randn(shape) * 4
    hf = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))  # LlamaRMSNorm, fp32
    with torch.no_grad():
        served = norm.serving()(x)
        trained = norm(x)
    assert torch.equal(served, hf) and torch.equal(served, trained)
    # bf16 activations (autocast) take torch's upcasting rms_norm, as training does
    xb = x.bfloat16()
    with torch.no_grad():
        assert torch.equal(norm.serving()(xb), norm(xb))
