"""x @ W^T for fp32 on an AVX2 CPU with W packed once at load (csrc/small_gemm.c): one read of W per call
whatever the row count, and a row's result independent of the rows beside it.

The C source is compiled on first use with the system C compiler into a per-user cache (keyed by the
source, so an edit rebuilds) and called through ctypes: no torch headers, no ninja. Where there is no
compiler, no AVX2/FMA or the build fails, ``available()`` is False, the reason is logged once, and callers
keep torch's matmul.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch
from torch import Tensor

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "small_gemm.c"
FLAGS = ["-O3", "-shared", "-fPIC", "-std=gnu11"]  # AVX2/FMA per function (target attribute in the source)
_P, _L = ctypes.c_void_p, ctypes.c_long


def cache_dir() -> Path:
    root = os.environ.get("DRAFTSMITH_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "draftsmith")
    return Path(root).expanduser()


def _build(compiler: str) -> Path:
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join([compiler, *FLAGS]).encode()).hexdigest()[:16]
    target = cache_dir() / f"small_gemm-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # several processes may build at once
            built = Path(tmp) / target.name
            subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built)], check=True, capture_output=True)
            os.replace(built, target)
    return target


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    if os.environ.get("DRAFTSMITH_SMALL_GEMM", "1") == "0":
        log.info("small-row GEMM kernel off (DRAFTSMITH_SMALL_GEMM=0); fp32 CPU matmuls use torch")
        return None
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if platform.machine().lower() not in ("x86_64", "amd64") or compiler is None:
        log.info("small-row GEMM kernel unavailable (machine %s, compiler %s); fp32 CPU matmuls use torch",
                 platform.machine(), compiler)
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.CalledProcessError) as err:
        detail = getattr(err, "stderr", b"") or b""
        log.warning("small-row GEMM kernel failed to build (%s %s); fp32 CPU matmuls use torch", err,
                    detail.decode(errors="replace")[:500])
        return None
    if not lib.small_gemm_has_avx2():
        log.info("small-row GEMM kernel unavailable (this CPU lacks AVX2/FMA); fp32 CPU matmuls use torch")
        return None
    lib.small_gemm_packed_floats.argtypes = [_L, _L]
    lib.small_gemm_packed_floats.restype = _L
    lib.small_gemm_pack.argtypes = [_P, _L, _L, _P]
    lib.small_gemm.argtypes = [_P, _L, _L, _L, _P, _L, _P, _P, _L]
    lib.small_gemm_pack.restype = lib.small_gemm.restype = None
    return lib


def available() -> bool:
    return _library() is not None


class PackedWeight:
    """W [N, K] fp32 on CPU, packed into [ceil(N/32), K, 32] panels; call with x [M, K] -> [M, N].

    A copy made once: a later in-place change to W (or to the module parameters aliasing it) does not reach
    it, as the serving form it belongs to is final (kernels.layers: inference only, built after loading)."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        lib = _library()
        if lib is None:
            raise RuntimeError("the small-row GEMM kernel is not available here (see small_gemm.available())")
        if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
            raise ValueError(f"PackedWeight takes a 2-D fp32 CPU weight, got {weight.dtype} {tuple(weight.shape)} "
                             f"on {weight.device}")
        self.out_features, self.in_features = (int(s) for s in weight.shape)
        dense = weight.detach().contiguous()
        # the C side sizes its own layout, so the panel width lives in one place
        self.packed = torch.empty(lib.small_gemm_packed_floats(self.out_features, self.in_features), dtype=torch.float32)
        lib.small_gemm_pack(dense.data_ptr(), self.out_features, self.in_features, self.packed.data_ptr())
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self._bias_ptr = None if self.bias is None else self.bias.data_ptr()

    def __call__(self, x: Tensor) -> Tensor:
        """x: [M, K] fp32 CPU -> [M, N]."""
        if x.dim() != 2 or x.shape[1] != self.in_features or x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError(f"PackedWeight [{self.out_features}, {self.in_features}] takes fp32 CPU rows "
                             f"[M, {self.in_features}], got {x.dtype} {tuple(x.shape)} on {x.device}")
        if x.stride(-1) != 1:
            x = x.contiguous()
        rows = x.shape[0]
        out = torch.empty(rows, self.out_features, dtype=torch.float32)
        if rows:  # the library is looked up per call, so the object deep-copies (no ctypes pointer held)
            _library().small_gemm(x.data_ptr(), rows, self.in_features, x.stride(0), self.packed.data_ptr(),
                                  self.out_features, self._bias_ptr, out.data_ptr(), self.out_features)
        return out
