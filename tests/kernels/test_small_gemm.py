"""The packed few-row fp32 GEMM (kernels.small_gemm): it matches a float64 reference, a row's result does not
depend on the rows beside it, the serving Linear routes 1..SMALL_GEMM_MAX_ROWS rows to it, and where it cannot
build, everything falls back to torch."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.kernels import native, small_gemm
from draftsmith.kernels.layers.linear import SMALL_GEMM_MAX_ROWS, Linear

needs_kernel = pytest.mark.skipif(not small_gemm.available(), reason="no C compiler or no AVX2/FMA on this CPU")


@needs_kernel
@pytest.mark.parametrize("out_features,in_features", [(64, 32), (45, 17), (1, 8), (4096, 256), (100, 704)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_a_float64_reference(out_features, in_features, bias):
    torch.manual_seed(out_features + in_features)
    weight = torch.randn(out_features, in_features)
    b = torch.randn(out_features) if bias else None
    packed = small_gemm.PackedWeight(weight, b)
    for rows in (1, 2, 3, 4, 5, 7, 9, 33):
        x = torch.randn(rows, in_features)
        ref = F.linear(x.double(), weight.double(), None if b is None else b.double())
        got = packed(x)
        assert got.shape == (rows, out_features) and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), ref, atol=1e-4 * in_features ** 0.5, rtol=1e-4)


@needs_kernel
def test_a_rows_result_does_not_depend_on_its_batch():
    """Within the kernel a row's output is bit for bit the same whatever rows share the call: every output is
    one FMA chain over k in the same order whatever the row count or grouping."""
    torch.manual_seed(0)
    packed = small_gemm.PackedWeight(torch.randn(70, 48), torch.randn(70))
    x = torch.randn(9, 48)
    alone = torch.cat([packed(x[i:i + 1]) for i in range(9)])
    for rows in range(1, 10):
        assert torch.equal(packed(x[:rows]), alone[:rows]), rows
    assert torch.equal(packed(x[::2]), alone[::2])  # strided rows (a view) read the same values


@pytest.mark.skipif(not small_gemm.uses_avx512(), reason="this CPU has no AVX-512F")
@pytest.mark.parametrize("storage", [torch.float32, torch.float16])
def test_avx512_form_equals_the_avx2_form_bit_for_bit(storage):
    """Every row count 1..64 (the AVX-512 form serves 7 and more: one group up to 12 rows, then several), widths
    that leave partial panels and odd panel counts, with and without bias, fp32 and fp16 panels: the two forms
    give the same bits."""
    torch.manual_seed(3)
    with small_gemm.panel_storage(storage):
        weights = [small_gemm.PackedWeight(torch.randn(n, k), torch.randn(n) if n % 2 else None)
                   for n, k in ((4096, 256), (1408, 256), (45, 17), (256, 704))]
    x = torch.randn(64, 704)
    try:
        for packed in weights:
            for rows in range(1, 65):
                rows_x = x[:rows, :packed.in_features]
                small_gemm.use_avx512(True)
                wide = packed(rows_x)
                small_gemm.use_avx512(False)
                assert torch.equal(wide, packed(rows_x)), (packed.out_features, packed.in_features, rows)
    finally:
        small_gemm.use_avx512(True)


@pytest.fixture
def gemm_threads():
    """Restores the process-wide GEMM split after a test that changes it."""
    before = native.threads()
    yield
    native.set_threads(before)


@needs_kernel
@pytest.mark.parametrize("storage", [torch.float32, torch.float16])
def test_a_gemm_split_over_threads_equals_the_one_thread_gemm_bit_for_bit(storage, gemm_threads):
    """Each thread computes whole panels of outputs, each output the same FMA chain: 2, 3 or 16 threads (more than
    the panels of a narrow weight, more than this machine's cores) give the one-thread bits, for every row count the
    native layers take, partial panels, odd panel counts and calls too small to split among them."""
    torch.manual_seed(4)
    with small_gemm.panel_storage(storage):
        weights = [small_gemm.PackedWeight(torch.randn(n, k), torch.randn(n) if n % 2 else None)
                   for n, k in ((4096, 256), (1408, 256), (45, 17), (256, 704), (17, 3))]
    x = torch.randn(SMALL_GEMM_MAX_ROWS, 704)
    for packed in weights:
        for rows in (1, 2, 5, 6, 7, 17, 33, SMALL_GEMM_MAX_ROWS):
            rows_x = x[:rows, :packed.in_features]
            native.set_threads(1)
            alone = packed(rows_x)
            for threads in (2, 3, 16):
                native.set_threads(threads)
                assert native.threads() == threads
                assert torch.equal(packed(rows_x), alone), (packed.out_features, packed.in_features, rows, threads)


@needs_kernel
def test_split_gemms_from_several_callers_and_a_forked_child_stay_exact(gemm_threads):
    """A call made while another thread holds the helpers runs on its own thread (same bits); a forked child, whose
    helpers did not come along, starts its own instead of waiting on them."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    torch.manual_seed(5)
    packed = small_gemm.PackedWeight(torch.randn(1408, 256), torch.randn(1408))
    x = torch.randn(17, 256)
    native.set_threads(1)
    alone = packed(x)
    native.set_threads(2)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: packed(x), range(64)))
    assert all(torch.equal(r, alone) for r in results)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:   # the child: one split call, then report (os._exit: no pytest teardown in the child)
        os.close(read)
        os.write(write, b"1" if torch.equal(packed(x), alone) else b"0")
        os._exit(0)
    os.close(write)
    _, status = os.waitpid(child, 0)
    assert os.read(read, 1) == b"1" and status == 0


@needs_kernel
def test_serving_linear_routes_few_rows_to_the_kernel(monkeypatch):
    torch.manual_seed(1)
    mods = [nn.Linear(32, 24, bias=True), nn.Linear(32, 40, bias=True)]
    fused = Linear.fuse(mods)
    assert fused.small is not None
    calls = []
    inner = fused.small.__call__
    monkeypatch.setattr(type(fused.small), "__call__", lambda self, x: calls.append(x.shape[0]) or inner(x))
    for rows in (1, 2, SMALL_GEMM_MAX_ROWS, SMALL_GEMM_MAX_ROWS + 1, 2 * SMALL_GEMM_MAX_ROWS):
        x = torch.randn(rows, 32)
        torch.testing.assert_close(fused(x), F.linear(x, fused.weight, fused.bias), atol=1e-5, rtol=1e-5)
    assert calls == [1, 2, SMALL_GEMM_MAX_ROWS]  # many rows stay with MKL's GEMM
    calls.clear()
    x = torch.randn(4, 32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # a multi-threaded step keeps MKL's threaded GEMM (the kernel is single-threaded)
        torch.testing.assert_close(fused(x), F.linear(x, fused.weight, fused.bias), atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(threads)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast keeps torch's (bf16) matmul
        assert fused(x).dtype == torch.bfloat16
    assert calls == []


@needs_kernel
def test_packed_weight_deep_copies_and_refuses_wrong_rows():
    import copy

    packed = small_gemm.PackedWeight(torch.randn(24, 16), torch.randn(24))
    x = torch.randn(3, 16)
    assert torch.equal(copy.deepcopy(packed)(x), packed(x))  # serving forms are deep-copied (proposers)
    with pytest.raises(ValueError, match=r"\[M, 16\].*\(3, 17\)"):
        packed(torch.randn(3, 17))


def test_switched_off_or_unbuildable_falls_back_to_torch(monkeypatch):
    monkeypatch.setenv("DRAFTSMITH_SMALL_GEMM", "0")
    small_gemm._library.cache_clear()
    try:
        assert not small_gemm.available()
        fused = Linear.fuse([nn.Linear(16, 8)])
        assert fused.small is None
        x = torch.randn(5, 16)
        torch.testing.assert_close(fused(x), F.linear(x, fused.weight, fused.bias), atol=1e-5, rtol=1e-5)
        with pytest.raises(RuntimeError, match="not available"):
            small_gemm.PackedWeight(torch.randn(8, 16))
    finally:
        small_gemm._library.cache_clear()


def test_a_missing_compiler_falls_back_with_the_reason_logged(monkeypatch, caplog, tmp_path):
    from draftsmith.kernels import native
    from draftsmith.kernels.attention import native_paged

    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))  # nothing built there: the compiler is needed
    caches = (native.library, small_gemm._library, native_paged._library)
    for cache in caches:
        cache.cache_clear()
    try:
        with caplog.at_level("INFO", logger=native.__name__):
            assert not small_gemm.available() and not native_paged.available()
        assert "fp32 CPU matmuls and attention use torch" in caplog.text
        assert caplog.text.count("native CPU kernels") == 1  # checked and logged once for every kernel
    finally:
        for cache in caches:
            cache.cache_clear()


@needs_kernel
def test_bad_weight_is_refused_naming_it():
    with pytest.raises(ValueError, match="bfloat16"):
        small_gemm.PackedWeight(torch.randn(8, 16, dtype=torch.bfloat16))


@needs_kernel
def test_fp16_panels_compute_in_fp32_on_the_rounded_weights():
    """A draft's fp16 panels: each weight is widened exactly to fp32 on load, so the result is bit for bit the fp32
    kernel's on the fp16-rounded weights, at every row count and with a bias."""
    torch.manual_seed(3)
    weight, bias = torch.randn(100, 48), torch.randn(100)
    with small_gemm.panel_storage(torch.float16):
        half = small_gemm.PackedWeight(weight, bias)
    rounded = small_gemm.PackedWeight(weight.half().float(), bias)
    assert half.half and half.packed.dtype == torch.float16 and not rounded.half
    assert half.packed.numel() == rounded.packed.numel()  # one layout, half the bytes
    for rows in (1, 2, 3, 5, 8, 9):
        x = torch.randn(rows, 48)
        assert torch.equal(half(x), rounded(x)), rows


@needs_kernel
def test_panel_storage_is_scoped_and_checked():
    with small_gemm.panel_storage(torch.float16):
        assert small_gemm.PackedWeight(torch.randn(16, 8)).half
    assert not small_gemm.PackedWeight(torch.randn(16, 8)).half  # restored on leaving
    with pytest.raises(ValueError, match="panel storage must be one of"):
        with small_gemm.panel_storage(torch.bfloat16):
            pass
