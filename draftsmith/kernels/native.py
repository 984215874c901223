"""The C kernels of ``kernels/csrc`` (fp32 on an x86-64 CPU with AVX2 + FMA), built once and loaded through ctypes.

Every source in csrc is compiled on first use with the system C compiler into one shared library in a per-user
cache (keyed by the sources and flags, so an edit rebuilds; written atomically, as several ranks may build at
once): no torch headers, no ninja. Only the functions that use AVX2 are compiled for it (a target attribute in
each source), so the CPU check runs anywhere. Where the machine is not x86-64, there is no compiler, the build
fails or the CPU lacks AVX2/FMA, ``library()`` is None, the reason is logged once, and every caller keeps its
torch path. Each kernel also has its own switch (an environment variable set to 0 turns it off).
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
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import torch
from torch import Tensor

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
FLAGS = ["-O3", "-shared", "-fPIC", "-std=gnu11", "-pthread"]
LIBS = ["-lm"]


def sources() -> list[Path]:
    return sorted(CSRC.glob("*.c"))


def cache_dir() -> Path:
    root = os.environ.get("DRAFTSMITH_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "draftsmith")
    return Path(root).expanduser()


def _build(compiler: str) -> Path:
    digest = hashlib.sha256(" ".join([compiler, *FLAGS, *LIBS]).encode())
    for source in sources() + sorted(CSRC.glob("*.h")):   # the headers they include count too
        digest.update(source.name.encode() + source.read_bytes())
    target = cache_dir() / f"draftsmith_native-{digest.hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            subprocess.run([compiler, *FLAGS, *map(str, sources()), "-o", str(built), *LIBS], check=True,
                           capture_output=True)
            os.replace(built, target)
    return target


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (reason logged) where they cannot run here."""
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if platform.machine().lower() not in ("x86_64", "amd64") or compiler is None:
        log.info("native CPU kernels unavailable (machine %s, compiler %s); fp32 CPU matmuls and attention use torch",
                 platform.machine(), compiler)
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.CalledProcessError) as err:
        detail = getattr(err, "stderr", b"") or b""
        log.warning("native CPU kernels failed to build (%s %s); fp32 CPU matmuls and attention use torch", err,
                    detail.decode(errors="replace")[:500])
        return None
    if not lib.draftsmith_has_avx2_fma():
        log.info("native CPU kernels unavailable (this CPU lacks AVX2/FMA); fp32 CPU matmuls and attention use torch")
        return None
    return lib


def set_threads(count: int) -> None:
    """Split the kernels' large enough calls over `count` threads (1, the default: never), process-wide: a GEMM's
    output panels, paged attention's (sequence, kv head) units. Bit for bit the one-thread results (csrc/parallel.c).
    A no-op where the kernels cannot run here."""
    lib = library()
    if lib is not None:
        lib.native_set_threads.argtypes, lib.native_set_threads.restype = [ctypes.c_int], None
        lib.native_set_threads(int(count))


def threads() -> int:
    """The threads a large enough kernel call is split over (1 where the kernels cannot run here)."""
    lib = library()
    if lib is None:
        return 1
    lib.native_threads.argtypes, lib.native_threads.restype = [], ctypes.c_int
    return int(lib.native_threads())


def eligible(x: Tensor, any_threads: bool = False) -> bool:
    """Whether a kernel here may take this activation: fp32 on the CPU, a step on one intra-op thread (the kernels
    run on one; a step the engine spreads over several keeps torch's threaded ops, unless any_threads: a kernel
    that beats torch's threaded path on one thread), no autograd (they have no backward), not under autocast
    (torch would run it in a lower precision) and not while torch.compile traces."""
    return (x.dtype == torch.float32 and x.device.type == "cpu" and (any_threads or torch.get_num_threads() == 1)
            and not (x.requires_grad and torch.is_grad_enabled()) and not torch.is_autocast_enabled("cpu")
            and not torch.compiler.is_compiling())


def address(tensor: Tensor | None) -> int:
    """A tensor's data address for a C pointer argument; 0 (NULL) for None."""
    return 0 if tensor is None else tensor.data_ptr()


def addresses(tensors: Sequence[Tensor | None]) -> Tensor:
    """int64 [n]: each tensor's address (0 for None), a C `const T *const *` argument's array."""
    return torch.tensor([address(t) for t in tensors], dtype=torch.int64)


Signature = tuple[list[type], type | None]  # (argtypes, restype) of one C function


def kernel_library(switch: str, what: str, signatures: dict[str, Signature]) -> ctypes.CDLL | None:
    """library() with these functions' ctypes signatures set, unless the kernel's own switch (environment
    variable ``switch`` = 0) turns ``what`` off."""
    if os.environ.get(switch, "1") == "0":
        log.info("%s off (%s=0); torch runs it", what, switch)
        return None
    lib = library()
    if lib is not None:
        for name, (argtypes, restype) in signatures.items():
            function = getattr(lib, name)
            function.argtypes, function.restype = argtypes, restype
    return lib
