"""A block draft's context injection in one C call (layers/native_context_kv.py) writes into every layer's cache what
the torch path (fuse, injected_kv, one write per layer) writes, and refuses a slot outside the caches whole."""
from __future__ import annotations

import pytest
import torch

from draftsmith.drafts.block import BlockDraft
from draftsmith.kernels import small_gemm
from draftsmith.kernels.attention import write_kv
from draftsmith.kernels.layers import native_context_kv
from spec_helpers import make_llama

needs_native = pytest.mark.skipif(native_context_kv._library() is None,
                                  reason="the native CPU kernels do not build here")
BLOCKS, BLOCK_SIZE = 8, 4


def serving_draft(tmp_path, panels: torch.dtype) -> BlockDraft:
    """2 layers, 2 KV heads, biased fc and k/v projections, random norms: every piece of the injection matters."""
    target = make_llama(tmp_path / "t", layers=4, hidden=64, num_attention_heads=4, num_key_value_heads=2,
                        attention_bias=True)
    torch.manual_seed(0)
    draft = BlockDraft.from_target_config(target, aux_layers=[1, 2, 3], num_layers=2, block_size=5, fc_bias=True)
    for p in draft.parameters():
        torch.nn.init.normal_(p, mean=1.0 if p.dim() == 1 else 0.0, std=0.3)
    with small_gemm.panel_storage(panels):
        return draft.eval().to_serving_()


def empty_caches(draft: BlockDraft) -> list[tuple[torch.Tensor, torch.Tensor]]:
    attn = draft.config.decoder
    shape = (BLOCKS, BLOCK_SIZE, attn.num_key_value_heads, attn.head_dim)
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(draft.num_layers)]


@needs_native
@pytest.mark.parametrize("panels", [torch.float32, torch.float16])
def test_native_injection_writes_what_the_torch_path_writes(tmp_path, panels, monkeypatch):
    draft = serving_draft(tmp_path, panels)
    assert draft.native_context is not None
    aux = torch.randn(6, 3 * 64)
    positions = torch.arange(10, 16)
    slots = torch.tensor([3, 7, 8, 20, 21, 30])
    native, reference = empty_caches(draft), empty_caches(draft)
    calls, inner = [], native_context_kv.NativeContextKV.__call__
    monkeypatch.setattr(native_context_kv.NativeContextKV, "__call__",
                        lambda self, *args: calls.append(1) or inner(self, *args))
    with torch.no_grad():
        draft.inject_context(aux, positions, 15, native, slots)
        kv = draft.injected_kv(draft.fuse(aux), positions, 15)
        for (k, v), (k_cache, v_cache) in zip(kv, reference):
            write_kv(k, v, k_cache, v_cache, slots)
    assert calls == [1]   # the C path ran
    for (k_native, v_native), (k_ref, v_ref) in zip(native, reference):
        torch.testing.assert_close(k_native, k_ref, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(v_native, v_ref, atol=2e-5, rtol=2e-5)
        untouched = torch.ones(BLOCKS * BLOCK_SIZE, dtype=torch.bool)
        untouched[slots] = False
        assert not k_native.view(BLOCKS * BLOCK_SIZE, -1)[untouched].any()
        assert k_native.view(BLOCKS * BLOCK_SIZE, -1)[slots].abs().sum(-1).min() > 0


@needs_native
def test_a_slot_outside_the_caches_is_refused_and_nothing_is_written(tmp_path):
    draft = serving_draft(tmp_path, torch.float32)
    caches = empty_caches(draft)
    with pytest.raises(ValueError, match="native context KV: a slot outside the cache"), torch.no_grad():
        draft.native_context(torch.randn(2, 3 * 64), *draft.rotary(torch.tensor([4, 5]), torch.float32, 5), caches,
                             torch.tensor([1, BLOCKS * BLOCK_SIZE]))
    assert not any(k.any() or v.any() for k, v in caches)


@needs_native
def test_rows_the_native_path_does_not_take_go_through_torch(tmp_path):
    """Slots that do not match the rows (or a step on several threads) keep the torch path."""
    draft = serving_draft(tmp_path, torch.float32)
    aux, caches = torch.randn(3, 3 * 64), empty_caches(draft)
    assert draft.native_context.accepts(aux, caches, torch.tensor([0, 1, 2]))
    assert not draft.native_context.accepts(aux, caches, torch.tensor([0, 1]))
    assert not draft.native_context.accepts(aux, caches[:1], torch.tensor([0, 1, 2]))
