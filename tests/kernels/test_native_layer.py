"""The native decoder layer (one C call per plain Llama block) against the same block through torch's ops, and where
it must not take over."""
from __future__ import annotations

import pytest
import torch

from draftsmith.kernels.attention import get_attention_backend, native_paged, paged_attn_fn
from draftsmith.kernels.layers import native_layer
from draftsmith.kernels.layers.linear import SMALL_GEMM_MAX_ROWS
from draftsmith.kernels.layers.config import DecoderConfig
from draftsmith.kernels.layers.decoder import DecoderLayer, decoder_block
from draftsmith.kernels.layers.family import LayerVariant
from draftsmith.kernels.layers.rope import RotaryEmbedding
from test_attention_kernels import _random_tree_mask, make_case

CFG = DecoderConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96)
needs_native = pytest.mark.skipif(native_layer._library() is None, reason="the native CPU kernels do not build here")


def serving_layer(seed: int = 0, bias: bool = False, **variant) -> DecoderLayer:
    torch.manual_seed(seed)
    cfg = DecoderConfig(**{**CFG.__dict__, "qkv_bias": bias, "o_bias": bias, "mlp_bias": bias})
    layer = DecoderLayer(cfg, variant=LayerVariant(**variant) if variant else None)
    for p in layer.parameters():  # norms away from 1 and biases away from 0, so both are exercised
        torch.nn.init.normal_(p, mean=1.0 if p.dim() == 1 and p.shape[0] in (16, 64) else 0.0, std=0.3)
    return layer.to_serving_()


def step(specs, seed, tree=False):
    """One step's inputs: hidden rows, rope rows and a paged attn_fn over a random cache (make_case's layout)."""
    gen = torch.Generator().manual_seed(seed)
    masks = [_random_tree_mask(q, gen) for q, _ in specs] if tree else None
    _, kc, vc, meta, _ = make_case(specs, num_heads=4, num_kv_heads=2, head_dim=16, seed=seed, tree_masks=masks)
    rows = sum(q for q, _ in specs)
    positions = torch.tensor([p for q, ctx in specs for p in range(ctx - q, ctx)])
    cos, sin = RotaryEmbedding(CFG)(positions, torch.float32)
    return torch.randn(rows, 64, generator=gen), cos, sin, kc, vc, meta


@needs_native
@pytest.mark.parametrize("specs,tree,bias", [([(1, 9)], False, False), ([(5, 20), (1, 7), (2, 2)], False, True),
                                              ([(6, 15), (2, 4)], True, False)])
def test_native_block_matches_the_torch_ops(specs, tree, bias, monkeypatch):
    """Decode rows, a verify chain after a prefix, a fresh short prompt and tree rows: the C block gives the torch
    block's output and writes the same K/V into the cache."""
    layer = serving_layer(bias=bias)
    hidden, cos, sin, kc, vc, meta = step(specs, seed=3, tree=tree)
    backend = get_attention_backend("torch")
    assert layer.serving_ops.native is not None
    assert layer.serving_ops.native.accepts(hidden, paged_attn_fn(backend, kc, vc, meta, 0.25))
    kc2, vc2 = kc.clone(), vc.clone()
    native = decoder_block(layer.serving_ops, hidden, cos, sin, paged_attn_fn(backend, kc, vc, meta, 0.25))
    monkeypatch.setattr(native_layer.NativeDecoderLayer, "accepts", lambda *a: False)
    monkeypatch.setattr(native_paged, "usable", lambda *a: False)
    monkeypatch.setattr(native_paged, "can_write", lambda *a: False)
    meta.backend_plan = None
    reference = decoder_block(layer.serving_ops, hidden, cos, sin, paged_attn_fn(backend, kc2, vc2, meta, 0.25))
    torch.testing.assert_close(native, reference, atol=1e-4, rtol=1e-4)  # fp32 rounding of norms and SiLU
    torch.testing.assert_close(kc, kc2, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(vc, vc2, atol=1e-6, rtol=1e-6)


@needs_native
def test_native_block_leaves_its_input_alone():
    """The residual stream it was given stays as it was (a caller may keep it as an auxiliary hidden state)."""
    layer = serving_layer()
    hidden, cos, sin, kc, vc, meta = step([(3, 8)], seed=1)
    before = hidden.clone()
    decoder_block(layer.serving_ops, hidden, cos, sin, paged_attn_fn(get_attention_backend("torch"), kc, vc, meta, 0.25))
    assert torch.equal(hidden, before)


def test_no_native_form_for_layers_it_does_not_implement():
    """q/k norms keep the torch block; a double-width attention input (EAGLE-3's) has a native form that
    decoder_block never hands the residual stream to (the layer's own forward builds that input)."""
    assert serving_layer(qk_norm=True).serving_ops.native is None
    wide = DecoderLayer(CFG, attn_input_size=128).to_serving_().serving_ops.native
    assert wide is None or not wide.reads_hidden


@needs_native
@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_eagle3_layer_matches_the_torch_ops(norm_before_residual, monkeypatch):
    """EAGLE-3's layer: its forward builds [norm(embeds) ; norm(hidden)] and hands it to the C block, which must
    give what the torch ops give."""
    from draftsmith.drafts.eagle3 import Eagle3MidLayer

    torch.manual_seed(7)
    layer = Eagle3MidLayer(CFG, norm_before_residual)
    for p in layer.parameters():
        torch.nn.init.normal_(p, mean=1.0 if p.dim() == 1 else 0.0, std=0.3)
    layer.to_serving_()
    native = layer.serving_ops.native
    assert native is not None and not native.reads_hidden and native.qkv.in_features == 128
    hidden, cos, sin, kc, vc, meta = step([(3, 11), (1, 4)], seed=8)
    embeds = torch.randn_like(hidden)
    backend = get_attention_backend("torch")
    kc2, vc2 = kc.clone(), vc.clone()
    calls = []
    real = native_layer.NativeDecoderLayer.__call__
    monkeypatch.setattr(native_layer.NativeDecoderLayer, "__call__", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        got = layer(embeds, hidden, cos, sin, paged_attn_fn(backend, kc, vc, meta, 0.25))
        assert calls, "the C block did not run"
        monkeypatch.setattr(native_layer.NativeDecoderLayer, "accepts", lambda *a: False)
        monkeypatch.setattr(native_paged, "usable", lambda *a: False)
        monkeypatch.setattr(native_paged, "can_write", lambda *a: False)
        meta.backend_plan = None
        reference = layer(embeds, hidden, cos, sin, paged_attn_fn(backend, kc2, vc2, meta, 0.25))
    torch.testing.assert_close(got, reference, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kc, kc2, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="reads 128 features, from attn_input"):
        real(native, hidden, cos, sin, paged_attn_fn(backend, kc, vc, meta, 0.25))


@needs_native
def test_eagle1_layer_without_input_norm_matches_the_torch_ops(monkeypatch):
    torch.manual_seed(5)
    layer = DecoderLayer(CFG, input_norm=False).to_serving_()
    assert layer.serving_ops.native is not None and layer.serving_ops.native.input_norm is None
    hidden, cos, sin, kc, vc, meta = step([(3, 11), (1, 4)], seed=6)
    backend = get_attention_backend("torch")
    kc2, vc2 = kc.clone(), vc.clone()
    native = decoder_block(layer.serving_ops, hidden, cos, sin, paged_attn_fn(backend, kc, vc, meta, 0.25))
    monkeypatch.setattr(native_layer.NativeDecoderLayer, "accepts", lambda *a: False)
    meta.backend_plan = None
    reference = decoder_block(layer.serving_ops, hidden, cos, sin, paged_attn_fn(backend, kc2, vc2, meta, 0.25))
    torch.testing.assert_close(native, reference, atol=1e-4, rtol=1e-4)  # fp32 rounding of norms and SiLU


@needs_native
def test_native_block_declines_what_it_does_not_serve():
    layer = serving_layer()
    native = layer.serving_ops.native
    backend = get_attention_backend("torch")
    hidden, cos, sin, kc, vc, meta = step([(1, 5)], seed=2)
    attn = paged_attn_fn(backend, kc, vc, meta, 0.25)
    assert native.accepts(hidden, attn)
    assert not native.accepts(hidden, lambda q, k, v: q)  # not a paged attention (a sliding window, a draft's own)
    assert not native.accepts(hidden.bfloat16(), attn)
    assert not native.accepts(hidden.requires_grad_(), attn)
    wide, _, _, kc9, vc9, meta9 = step([(SMALL_GEMM_MAX_ROWS + 1, SMALL_GEMM_MAX_ROWS + 6)], seed=2)  # more rows than it takes
    assert not native.accepts(wide, paged_attn_fn(backend, kc9, vc9, meta9, 0.25))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert not native.accepts(hidden.detach(), attn)
    finally:
        torch.set_num_threads(threads)


def test_switched_off_it_is_not_built(monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_NATIVE_LAYER", "0")
    native_layer._library.cache_clear()
    try:
        assert serving_layer().serving_ops.native is None
    finally:
        native_layer._library.cache_clear()


@needs_native
def test_bad_metadata_is_refused_naming_it():
    layer = serving_layer()
    hidden, cos, sin, kc, vc, meta = step([(2, 6)], seed=4)
    meta.slot_mapping = torch.tensor([5, 10_000])
    with pytest.raises(ValueError, match="KV slot outside the cache"):
        layer.serving_ops.native(hidden, cos, sin, paged_attn_fn(get_attention_backend("torch"), kc, vc, meta, 0.25))
