"""Paged attention backends against a dense, independently computed reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from draftsmith.kernels.attention import (
    AttentionMetadata,
    attention,
    get_attention_backend,
    native_paged,
    select_backend,
    write_kv,
)

REPO = Path(__file__).resolve().parents[2]


def make_case(specs, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, seed=0, tree_masks=None,
              dtype=torch.float32, device="cpu"):
    """Random paged batch. specs: [(q_len, ctx_len)] per sequence; blocks handed out in shuffled order.

    Returns (q, k_cache, v_cache, meta, dense) where dense[i] = (q_i [L,H,D], K_i [S,kvh,D], V_i, mask_i [L,S]).
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-ctx // block_size) for _, ctx in specs]
    num_blocks = sum(blocks_needed) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen, dtype=dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen, dtype=dtype)
    tables, dense, queries, tree_rows = [], [], [], []
    for i, (q_len, ctx) in enumerate(specs):
        tables.append([order.pop() for _ in range(blocks_needed[i])])
        keys = torch.randn(ctx, num_kv_heads, head_dim, generator=gen, dtype=dtype)
        values = torch.randn(ctx, num_kv_heads, head_dim, generator=gen, dtype=dtype)
        slots = torch.tensor([tables[i][p // block_size] * block_size + p % block_size for p in range(ctx)])
        write_kv(keys, values, k_cache, v_cache, slots)
        q = torch.randn(q_len, num_heads, head_dim, generator=gen, dtype=dtype)
        queries.append(q)
        mask = torch.ones(q_len, ctx, dtype=torch.bool)
        local = tree_masks[i] if tree_masks is not None else torch.ones(q_len, q_len, dtype=torch.bool).tril()
        mask[:, ctx - q_len:] = local
        dense.append((q, keys, values, mask))
        tree_rows.append(local)
    tree = None
    if tree_masks is not None:
        width = max(q for q, _ in specs)
        tree = torch.zeros(sum(q for q, _ in specs), width, dtype=torch.bool)
        row = 0
        for (q_len, _), local in zip(specs, tree_rows):
            tree[row:row + q_len, :q_len] = local
            row += q_len
    meta = AttentionMetadata.build([q for q, _ in specs], [c for _, c in specs], tables, block_size, device,
                                   tree_mask=None if tree is None else tree.to(device))
    return torch.cat(queries).to(device), k_cache.to(device), v_cache.to(device), meta, dense


def dense_reference(dense, scale):
    """Masked softmax attention per sequence in float64, written with explicit head-group expansion."""
    outs = []
    for q, keys, values, mask in dense:
        group = q.shape[1] // keys.shape[1]
        k = keys.double().repeat_interleave(group, dim=1)  # [S, H, D]
        v = values.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("lhd,shd->hls", q.double(), k) * scale
        scores = scores.masked_fill(~mask[None], float("-inf"))
        outs.append(torch.einsum("hls,shd->lhd", torch.softmax(scores, -1), v))
    return torch.cat(outs)


MIXED = [(5, 12), (1, 9), (7, 7), (1, 1), (3, 20)]  # chunked prefill, decode, fresh prefill, first token, chunk


def torch_ops_only(monkeypatch):
    monkeypatch.setattr(native_paged, "usable", lambda *a: False)
    monkeypatch.setattr(native_paged, "can_write", lambda *a: False)


@pytest.fixture(params=["torch", "native"])
def attention_path(request, monkeypatch):
    """The torch backend's two ways through a fp32 CPU layer: its torch ops, or the C kernel (native_paged),
    which the test then must have called."""
    if request.param == "torch":
        torch_ops_only(monkeypatch)
        yield request.param
        return
    if not native_paged.available():
        pytest.skip("the native CPU kernels do not build or run here")
    calls = []
    inner = native_paged.attend
    monkeypatch.setattr(native_paged, "attend", lambda *a, **kw: calls.append(1) or inner(*a, **kw))
    yield request.param
    assert calls, "the native kernel never ran"


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (4, 4), (4, 1)])
def test_torch_paged_matches_dense_on_mixed_batch(attention_path, num_heads, num_kv_heads):
    """Chunked prefill, decode and fresh prefill in one batch, with MHA/GQA/MQA and shuffled blocks."""
    q, kc, vc, meta, dense = make_case(MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads)
    out = attention(q, kc, vc, meta, scale=0.25)
    torch.testing.assert_close(out.double(), dense_reference(dense, 0.25), atol=1e-5, rtol=1e-5)


def test_torch_paged_pure_decode_batch_path(attention_path):
    """The vectorized all-decode path (padded gather + length mask) equals the dense reference."""
    specs = [(1, n) for n in (1, 4, 5, 17, 3, 8)]
    q, kc, vc, meta, dense = make_case(specs, seed=3)
    assert meta.is_pure_decode
    out = attention(q, kc, vc, meta, scale=0.3)
    torch.testing.assert_close(out.double(), dense_reference(dense, 0.3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_torch_paged_batches_verify_blocks(dtype, tol, monkeypatch):
    """Short causal blocks after a prefix (a chain's K+1 verify rows) are served together, bucketed by
    their length with decode rows beside them; a long block (a prefill chunk) still goes through SDPA."""
    from draftsmith.kernels.attention import torch_paged

    torch_ops_only(monkeypatch)  # the torch ops' plan (fp32 could go native)

    long_block = torch_paged.MAX_BATCHED_QUERY_ROWS + 1
    specs = [(5, 12), (5, 40), (1, 9), (5, 6), (3, 20), (long_block, long_block + 4), (5, 5)]
    q, kc, vc, meta, dense = make_case(specs, seed=11, dtype=dtype)
    out = attention(q, kc, vc, meta, scale=0.25)
    torch.testing.assert_close(out.double(), dense_reference(dense, 0.25), atol=tol, rtol=tol)
    plan = meta.backend_plan
    # Not the lone 3-token block, the long block, or the fresh prefill (no prefix).
    assert plan.batched_seqs == {0, 1, 2, 3}
    assert sorted({b.q_len for b in plan.buckets}) == [1, 5]


def _random_tree_mask(q_len, gen):
    """Ancestor mask of a random tree over q_len nodes (node 0 = root); node j sees itself and its ancestors."""
    parents = [-1] + [int(torch.randint(0, j, (1,), generator=gen)) for j in range(1, q_len)]
    mask = torch.zeros(q_len, q_len, dtype=torch.bool)
    for j in range(q_len):
        node = j
        while node != -1:
            mask[j, node] = True
            node = parents[node]
    return mask


def test_torch_paged_tree_mask(attention_path):
    """Tree verification: each query sees the context prefix plus exactly its tree ancestors."""
    gen = torch.Generator().manual_seed(7)
    specs = [(6, 15), (1, 4), (4, 9)]
    masks = [_random_tree_mask(q, gen) for q, _ in specs]
    q, kc, vc, meta, dense = make_case(specs, tree_masks=masks, seed=5)
    out = attention(q, kc, vc, meta, scale=0.25)
    torch.testing.assert_close(out.double(), dense_reference(dense, 0.25), atol=1e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(
    specs=st.lists(st.tuples(st.integers(1, 6), st.integers(0, 14)), min_size=1, max_size=5),
    block_size=st.sampled_from([1, 2, 4, 8]),
    kv_heads=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 1000),
)
def test_torch_paged_property(specs, block_size, kv_heads, seed):
    """Any mix of (new tokens, prefix length) and block size: paged result equals dense attention, through the
    torch ops and through the C kernel alike (head sizes 16 and 8: the kernel's dot product has a tail)."""
    specs = [(q_len, q_len + prefix) for q_len, prefix in specs]
    head_dim = 8 if seed % 2 else 16
    q, kc, vc, meta, dense = make_case(specs, num_kv_heads=kv_heads, block_size=block_size, seed=seed,
                                       head_dim=head_dim)
    expected = dense_reference(dense, 0.25)
    with pytest.MonkeyPatch.context() as patch:
        torch_ops_only(patch)
        torch.testing.assert_close(attention(q, kc, vc, meta, scale=0.25).double(), expected, atol=1e-5, rtol=1e-5)
    if native_paged.available():
        native, skipped = native_paged.attend(q, kc, vc, meta, 0.25, max_q_len=64)
        assert skipped == 0
        torch.testing.assert_close(native.double(), expected, atol=1e-5, rtol=1e-5)


needs_native = pytest.mark.skipif(not native_paged.available(), reason="the native CPU kernels do not build here")


@needs_native
def test_native_serves_short_blocks_and_leaves_prefill_chunks_to_sdpa():
    """One kernel call serves every sequence with up to MAX_BATCHED_QUERY_ROWS new tokens; a longer prefill
    chunk goes through SDPA, and the two halves make one exact output."""
    from draftsmith.kernels.attention import torch_paged

    long_block = torch_paged.MAX_BATCHED_QUERY_ROWS + 3
    specs = [(5, 12), (long_block, long_block + 6), (1, 9), (long_block, long_block)]
    q, kc, vc, meta, dense = make_case(specs, seed=4, head_dim=64, num_heads=8, num_kv_heads=2)
    assert native_paged.usable(q, kc, vc)
    out = attention(q, kc, vc, meta, scale=0.125)
    torch.testing.assert_close(out.double(), dense_reference(dense, 0.125), atol=1e-5, rtol=1e-5)
    assert meta.backend_plan.batched_seqs == {0, 2}  # the kernel's; 1 and 3 went through SDPA


@needs_native
def test_native_reads_strided_views_of_a_projection():
    """q, k and v arrive as views of one [T, (H + 2 KVH) * D] projection (decoder.attend): the kernel and the
    KV write follow their strides."""
    specs = [(3, 10), (1, 6)]
    q, kc, vc, meta, dense = make_case(specs, seed=8, head_dim=16)
    ref_kc, ref_vc = kc.clone(), vc.clone()
    k_new, v_new = torch.randn(4, 2, 16), torch.randn(4, 2, 16)
    packed = torch.cat([q.reshape(4, -1), k_new.reshape(4, -1), v_new.reshape(4, -1)], dim=1)
    q_view = packed[:, :64].view(4, 4, 16)
    k_view, v_view = packed[:, 64:96].view(4, 2, 16), packed[:, 96:].view(4, 2, 16)
    assert native_paged.can_write(k_view, v_view, kc, vc, meta.slot_mapping)
    write_kv(k_view, v_view, kc, vc, meta.slot_mapping)
    flat = ref_kc.view(-1, 2, 16), ref_vc.view(-1, 2, 16)
    flat[0].index_copy_(0, meta.slot_mapping, k_new)
    flat[1].index_copy_(0, meta.slot_mapping, v_new)
    assert torch.equal(kc, ref_kc) and torch.equal(vc, ref_vc)
    with pytest.MonkeyPatch.context() as patch:
        torch_ops_only(patch)
        expected = attention(q.contiguous(), kc, vc, meta, 0.25)
    out, _ = native_paged.attend(q_view, kc, vc, meta, 0.25, 16)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@needs_native
def test_native_write_refuses_a_slot_outside_the_cache():
    kc, vc = torch.zeros(3, 4, 2, 8), torch.zeros(3, 4, 2, 8)
    with pytest.raises(IndexError, match="12 slots"):
        write_kv(torch.randn(2, 2, 8), torch.randn(2, 2, 8), kc, vc, torch.tensor([3, 12]))
    assert kc.abs().sum() == 0  # nothing written


@needs_native
def test_native_tree_row_that_sees_nothing_attends_to_nothing():
    """A tree row masked everywhere (no prefix, not even itself) gives zeros, as the torch ops do, not NaN."""
    tree = torch.tensor([[True, False], [False, False]])
    q, kc, vc, meta, _ = make_case([(2, 2)], tree_masks=[tree], seed=6)
    out, _ = native_paged.attend(q, kc, vc, meta, 0.25, 16)
    assert torch.isfinite(out).all() and torch.equal(out[1], torch.zeros_like(out[1]))


@needs_native
def test_native_refuses_metadata_that_does_not_hold_together():
    q, kc, vc, meta, _ = make_case([(3, 10), (1, 6)], seed=3)
    meta.seq_lens = torch.tensor([10, 600], dtype=torch.int32)  # past its block table
    with pytest.raises(ValueError, match="does not hold together"):
        native_paged.attend(q, kc, vc, meta, 0.25, 16)


def test_native_attention_serves_any_thread_count_and_switched_off_uses_torch(monkeypatch):
    q, kc, vc, meta, dense = make_case([(1, 9), (4, 12)], seed=2)
    if native_paged.available():
        assert native_paged.usable(q, kc, vc)
        previous = torch.get_num_threads()
        torch.set_num_threads(2)
        try:  # a step spread over threads (a wide batch) still takes the one-thread kernel: it beats torch's path
            assert native_paged.usable(q, kc, vc)
        finally:
            torch.set_num_threads(previous)
    assert not native_paged.usable(q.bfloat16(), kc.bfloat16(), vc.bfloat16())
    assert not native_paged.usable(q.requires_grad_(), kc, vc)  # no backward in C
    q = q.detach()
    monkeypatch.setenv("DRAFTSMITH_NATIVE_ATTENTION", "0")
    native_paged._library.cache_clear()
    try:
        assert not native_paged.usable(q, kc, vc)
        out = attention(q, kc, vc, meta, scale=0.25)
        torch.testing.assert_close(out.double(), dense_reference(dense, 0.25), atol=1e-5, rtol=1e-5)
    finally:
        native_paged._library.cache_clear()


def test_write_kv_places_rows_in_slots():
    """write_kv puts token t's K/V at cache[slot // bs, slot % bs]."""
    kc = torch.zeros(3, 4, 2, 8)
    vc = torch.zeros(3, 4, 2, 8)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    write_kv(k, v, kc, vc, torch.tensor([9, 0, 6]))
    torch.testing.assert_close(kc[2, 1], k[0])
    torch.testing.assert_close(vc[1, 2], v[2])
    assert kc[0, 1].abs().sum() == 0


def test_metadata_rejects_bad_shapes():
    """Inconsistent metadata fails with a ValueError naming the field."""
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        AttentionMetadata(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1, 2], dtype=torch.int32),
                          torch.zeros(2, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int64), 1, 2)
    with pytest.raises(ValueError, match="block table"):
        AttentionMetadata.build([1], [9], [[0, 1]], block_size=4)


def test_backend_selection_on_cpu():
    """Without CUDA, auto picks torch; asking for flash fails clearly; unknown names are rejected."""
    if torch.cuda.is_available():
        pytest.skip("CPU-only selection test")
    assert select_backend("auto") == "torch"
    assert get_attention_backend("auto") is get_attention_backend("torch")
    with pytest.raises(ValueError, match="flash"):
        select_backend("flash")
    with pytest.raises(ValueError, match="attn_backend"):
        select_backend("xformers")


_TRITON_CHECK = r"""
import os, sys, json
os.environ["TRITON_INTERPRET"] = "1"
sys.path[:0] = __TESTS__   # the test folders, as tests/conftest.py puts them
import torch
from draftsmith.kernels.attention.triton_paged import paged_attention as triton_attention
from draftsmith.kernels.attention import attention
from test_attention_kernels import make_case, _random_tree_mask
diffs = []
cases = [
    dict(specs=[(5, 12), (1, 9), (7, 7), (1, 1), (3, 20)], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4),
    dict(specs=[(1, 3), (1, 40), (1, 17)], num_heads=4, num_kv_heads=1, head_dim=8, block_size=16),
    dict(specs=[(20, 37), (2, 5)], num_heads=2, num_kv_heads=2, head_dim=24, block_size=8),
]
for i, case in enumerate(cases):
    q, kc, vc, meta, _ = make_case(seed=i, **case)
    diffs.append((triton_attention(q, kc, vc, meta, 0.25) - attention(q, kc, vc, meta, 0.25)).abs().max().item())
gen = torch.Generator().manual_seed(1)
specs = [(6, 15), (1, 4), (4, 9)]
q, kc, vc, meta, _ = make_case(specs, tree_masks=[_random_tree_mask(n, gen) for n, _ in specs], seed=9)
diffs.append((triton_attention(q, kc, vc, meta, 0.25) - attention(q, kc, vc, meta, 0.25)).abs().max().item())
# End to end: the executor on the triton backend gives the torch backend's logits over mixed steps.
from test_executor import SHAPE, PagedRunner
from tiny_models import tiny_model
from draftsmith.serve_eval.engine.model_executor import ModelExecutor
model = tiny_model(shape=SHAPE)
runners = [PagedRunner(ModelExecutor.from_hf_model(model, attn_backend=b)) for b in ("torch", "triton")]
worst = 0.0
for work in ({"A": list(range(9)), "B": [4, 5, 6]}, {"A": [1, 2, 3], "B": [7]}, {"A": [8], "B": [9]}):
    rows = [r.step(work)[0] for r in runners]
    worst = max(worst, max((rows[0][n] - rows[1][n]).abs().max().item() for n in work))
diffs.append(worst)
print(json.dumps(diffs))
"""


def test_triton_matches_torch_under_interpreter():
    """The Triton kernel (interpreted on CPU, fp32) equals the torch reference on mixed prefill/decode,
    MQA/GQA/MHA, block sizes 4-16, a non-power-of-two head dim and a tree mask; and the executor on the triton
    backend reproduces the torch backend's logits over chunked-prefill and decode steps."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the compiled kernel instead (test_triton_compiled_on_cuda_...)")
    tests = REPO / "tests"
    folders = [str(tests), *(str(d) for d in sorted(tests.rglob("*")) if d.is_dir() and d.name != "__pycache__")]
    code = _TRITON_CHECK.replace("__TESTS__", repr(folders))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    diffs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(diffs) == 5 and max(diffs) < 1e-4, diffs


def test_triton_launch_plan_is_built_once_per_forward_and_tiles_as_the_general_path():
    """Every layer of a forward reuses the first layer's plan; the one-tile-per-sequence shortcut (queries of
    at most one tile: decode, verify rounds) gives the same tiles as the general tiling."""
    pytest.importorskip("triton")
    from draftsmith.kernels.attention.triton_paged import _query_tiles, launch_plan

    for specs in ([(1, 5), (1, 9)], [(5, 12), (16, 20), (1, 1)], [(20, 37), (2, 5)], [(1, 3)] * 7):
        _, _, _, meta, _ = make_case(specs)
        plan = launch_plan(meta)
        assert launch_plan(meta) is plan
        tile_seq, tile_qstart = _query_tiles(meta.cu_seqlens_q, plan.block_m)
        assert torch.equal(plan.tile_seq, tile_seq) and torch.equal(plan.tile_qstart, tile_qstart), specs


CUDA_CASES = [
    dict(specs=[(5, 12), (1, 9), (7, 7), (1, 1), (3, 20)], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4),
    dict(specs=[(1, 3), (1, 40), (1, 17)], num_heads=4, num_kv_heads=1, head_dim=8, block_size=16),
    dict(specs=[(20, 37), (2, 5)], num_heads=2, num_kv_heads=2, head_dim=24, block_size=8),
    dict(specs=[(1, 300), (16, 130), (1, 1)], num_heads=32, num_kv_heads=4, head_dim=64, block_size=16),
]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/check_gpu.sh runs it)")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
def test_triton_compiled_on_cuda_matches_the_float64_reference(dtype, tol):
    """The compiled Triton kernel on a GPU, causal and tree-masked cases, MQA/GQA/MHA, a Llama-sized head, against
    float64 dense attention of the same inputs (fp32 runs the dots in IEEE fp32, not tf32)."""
    from draftsmith.kernels.attention.triton_paged import paged_attention as triton_attention

    gen = torch.Generator().manual_seed(1)
    tree_specs = [(6, 15), (1, 4), (4, 9)]
    cases = [dict(case, seed=i) for i, case in enumerate(CUDA_CASES)]
    cases.append(dict(specs=tree_specs, tree_masks=[_random_tree_mask(n, gen) for n, _ in tree_specs], seed=9))
    for case in cases:
        q, kc, vc, meta, dense = make_case(**case, dtype=dtype, device="cuda")
        got = triton_attention(q, kc, vc, meta, 0.25).double().cpu()
        want = dense_reference(dense, 0.25)
        assert (got - want).abs().max().item() < tol, case["specs"]


def test_bench_batch_verify_runs_both_paths_side_by_side(tmp_path):
    """scripts/bench_batch_verify.py on untrained models: every cell measured, and the ratio line printed."""
    proc = subprocess.run([sys.executable, "scripts/bench_batch_verify.py", "--artifacts", str(tmp_path),
                           "--methods", "standalone", "--batch-sizes", "2", "--repeats", "1", "--max-tokens", "4",
                           "--prompts-per-domain", "1", "--dtype", "float32"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("batch 2: ")]
    assert [line.split()[2] for line in lines[:3]] == ["nospec", "standalone", "standalone/per-seq"]
    assert "standalone batched verify / per-sequence" in lines[-1]


@needs_native
@pytest.mark.parametrize("tree", [False, True])
def test_native_attention_split_over_threads_equals_one_thread_bit_for_bit(tree):
    """The (sequence, kv head) units split over 2, 3 or 16 threads (more than the units): each unit is computed whole
    in the one-thread order, so every output bit is the one-thread output's; with tree masks as with causal rows."""
    from draftsmith.kernels import native

    specs = [(5, 300), (1, 97), (3, 40), (1, 1), (4, 128)]
    masks = None
    if tree:   # each row sees the root and itself (a star tree), the root only itself
        masks = [torch.eye(q_len, dtype=torch.bool) | (torch.arange(q_len) == 0) for q_len, _ in specs]
    q, kc, vc, meta, _ = make_case(specs, num_heads=8, num_kv_heads=4, head_dim=64, block_size=16, seed=7,
                                   tree_masks=masks)
    before = native.threads()
    try:
        native.set_threads(1)
        alone, _ = native_paged.attend(q, kc, vc, meta, 0.125, 16)
        for threads in (2, 3, 16):
            native.set_threads(threads)
            split, skipped = native_paged.attend(q, kc, vc, meta, 0.125, 16)
            assert skipped == 0 and torch.equal(split, alone), threads
    finally:
        native.set_threads(before)
