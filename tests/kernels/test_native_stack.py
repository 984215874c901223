"""The native stack (every layer of a CausalLM in one C call) against the same model layer by layer, and where it
must not take over."""
from __future__ import annotations

import pytest
import torch

from draftsmith.kernels import small_gemm
from draftsmith.kernels.attention import get_attention_backend, paged_attn_fn
from draftsmith.kernels.layers import native_stack
from draftsmith.kernels.layers.causal_lm import CausalLM, LMShape
from draftsmith.kernels.layers.config import DecoderConfig
from test_attention_kernels import make_case

needs_native = pytest.mark.skipif(native_stack._library() is None, reason="the native CPU kernels do not build here")
NUM_LAYERS = 3


def serving_model(seed: int = 0, panels: torch.dtype = torch.float32) -> CausalLM:
    torch.manual_seed(seed)
    decoder = DecoderConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            intermediate_size=96)
    model = CausalLM(LMShape(vocab_size=50, num_layers=NUM_LAYERS, decoder=decoder, tie_word_embeddings=False)).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, mean=1.0 if p.dim() == 1 else 0.0, std=0.3)
    with small_gemm.panel_storage(panels):
        return model.to_serving_()


def forward(model: CausalLM, specs, seed: int, aux_layers=()):
    """One step over fresh per-layer caches (make_case's layout); -> (hidden, aux, caches)."""
    caches, metas = [], []
    for layer in range(NUM_LAYERS):
        _, kc, vc, meta, _ = make_case(specs, num_heads=4, num_kv_heads=2, head_dim=16, seed=seed + layer)
        caches.append((kc, vc))
        metas.append(meta)
    meta = metas[0]  # one step: every layer reads the same metadata (make_case builds it from the specs)
    backend = get_attention_backend("torch")
    fns = [paged_attn_fn(backend, kc, vc, meta, 0.25) for kc, vc in caches]
    ids = torch.arange(sum(q for q, _ in specs)) % 50
    positions = torch.tensor([p for q, ctx in specs for p in range(ctx - q, ctx)])
    with torch.no_grad():
        hidden, aux = model.run(ids, positions, fns, aux_layers)
    return hidden, aux, caches


@needs_native
@pytest.mark.parametrize("panels", [torch.float32, torch.float16])
def test_the_stack_gives_the_layer_by_layer_result_bit_for_bit(panels, monkeypatch):
    """Decode rows, a verify chain and a short prompt in one step: the stack's hidden, auxiliary hidden states and
    KV writes equal the per-layer native path's exactly (the same C layer, called from C)."""
    model = serving_model(panels=panels)
    assert model.native_stack is not None and model.native_stack.layers[0].qkv.half == (panels == torch.float16)
    specs, aux_layers = [(1, 9), (5, 20), (2, 2)], (0, 1, 2, NUM_LAYERS)
    calls = []
    real = native_stack.NativeStack.__call__
    monkeypatch.setattr(native_stack.NativeStack, "__call__", lambda *a, **k: calls.append(1) or real(*a, **k))
    hidden, aux, caches = forward(model, specs, seed=5, aux_layers=aux_layers)
    assert calls, "the stack did not run"
    monkeypatch.setattr(native_stack.NativeStack, "accepts", lambda *a: False)
    ref_hidden, ref_aux, ref_caches = forward(model, specs, seed=5, aux_layers=aux_layers)
    assert torch.equal(hidden, ref_hidden)
    assert sorted(aux) == sorted(ref_aux) == sorted(aux_layers)
    for index in aux_layers:
        assert torch.equal(aux[index], ref_aux[index]), index
    for (kc, vc), (rk, rv) in zip(caches, ref_caches):
        assert torch.equal(kc, rk) and torch.equal(vc, rv)


@needs_native
def test_the_stack_declines_what_a_layer_declines():
    model = serving_model()
    stack = model.native_stack
    _, kc, vc, meta, _ = make_case([(1, 9)], num_heads=4, num_kv_heads=2, head_dim=16, seed=0)
    backend = get_attention_backend("torch")
    fns = [paged_attn_fn(backend, kc, vc, meta, 0.25)] * NUM_LAYERS
    assert stack.accepts(torch.randn(1, 64), fns)
    assert not stack.accepts(torch.randn(1, 64), fns[:-1])  # one attention per layer
    assert not stack.accepts(torch.randn(9, 64), fns)  # more rows than the kernels take
    assert not stack.accepts(torch.randn(1, 64, dtype=torch.float64), fns)
    other = paged_attn_fn(backend, kc, vc, meta, 0.5)
    assert not stack.accepts(torch.randn(1, 64), fns[:-1] + [other])  # one scale


def test_no_stack_unless_every_layer_is_native():
    assert native_stack.NativeStack.build([]) is None
    assert native_stack.NativeStack.build([None, None]) is None


@needs_native
def test_a_one_layer_model_keeps_its_layers_own_call():
    """A stack of one layer would only add its address arrays to that layer's own call."""
    layers = serving_model().native_stack.layers
    assert native_stack.NativeStack.build(layers[:1]) is None
    assert native_stack.NativeStack.build(layers[:2]) is not None


@needs_native
def test_cache_addresses_are_built_once_per_cache_placement():
    """Two steps over the same caches reuse one address array; a stack deep-copied with its model gets its own
    address arrays (the original's point at the original's weights)."""
    import copy

    model = serving_model()
    _, kc, vc, meta, _ = make_case([(1, 9)], num_heads=4, num_kv_heads=2, head_dim=16, seed=0)
    caches = [(kc.clone(), vc.clone()) for _ in range(NUM_LAYERS)]
    fns = [paged_attn_fn(get_attention_backend("torch"), k, v, meta, 0.25) for k, v in caches]
    with torch.no_grad():
        first = model.run(torch.tensor([3]), torch.tensor([8]), fns)[0]
        arrays = model.native_stack.caches.addresses(caches)
        model.run(torch.tensor([3]), torch.tensor([8]), fns)
    assert model.native_stack.caches.addresses(caches) is arrays
    assert model.native_stack.caches.served(caches) and not model.native_stack.caches.served(caches[:-1])
    twin = copy.deepcopy(model)
    assert twin.native_stack is not None and twin.native_stack.layers[0] is not model.native_stack.layers[0]
    assert not torch.equal(twin.native_stack.addresses["qkv"], model.native_stack.addresses["qkv"])
    del model
    with torch.no_grad():  # the copy runs on its own weights (same values: the same output)
        again = twin.run(torch.tensor([3]), torch.tensor([8]), fns)[0]
    assert torch.equal(again, first)


@needs_native
def test_last_rows_leave_the_last_layer_alone_with_the_full_calls_values():
    """A block draft reads a few rows of its last layer: the stack then returns those rows only, bit for bit the
    full call's, with every row's K and V written as in the full call; rows that are not strictly ascending rows of
    the step are refused."""
    model = serving_model()
    specs = [(5, 20), (4, 9)]
    rows = sum(q for q, _ in specs)
    cases = [make_case(specs, num_heads=4, num_kv_heads=2, head_dim=16, seed=7 + layer) for layer in range(NUM_LAYERS)]
    backend = get_attention_backend("torch")

    def run(last_rows=None):
        caches = [(kc.clone(), vc.clone()) for _, kc, vc, _, _ in cases]
        fns = [paged_attn_fn(backend, kc, vc, cases[0][3], 0.25) for kc, vc in caches]
        hidden = model.model.embed_tokens(torch.arange(rows) % 50)
        positions = torch.tensor([p for q, ctx in specs for p in range(ctx - q, ctx)])
        cos, sin = model.rotary(positions, hidden.dtype)
        with torch.no_grad():
            return model.native_stack(hidden, cos, sin, fns, last_rows=last_rows)[0], caches

    full, full_caches = run()
    keep = torch.tensor([1, 2, 6, 8])
    kept, kept_caches = run(keep)
    assert kept.shape == (4, 64) and torch.equal(kept, full[keep])
    for (kc, vc), (rk, rv) in zip(kept_caches, full_caches):
        assert torch.equal(kc, rk) and torch.equal(vc, rv)
    for bad in ([2, 1], [0, 0], [rows]):
        with pytest.raises(ValueError, match="last rows that are not strictly ascending rows of the step"):
            run(torch.tensor(bad))
