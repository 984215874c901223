"""Whether bf16 compute pays on this machine, measured once per device, and the `auto` settings that read it.

bf16 autocast is the embedded profile's way to train fast on a CPU with native bf16 (AVX512-BF16 / AMX): a
matmul runs about 2x faster than in fp32. A CPU without it (AVX2 only, e.g. many AMD EPYC hosts) emulates
bf16, and there a matmul ran 92x SLOWER than fp32 (512 x 256 x 1024 at one thread: 3.9 ms fp32 against 360 ms
bf16, torch 2.13 CPU build; the probe's smaller shape 36-46x): the embedded target trained at 55 s a step instead
of 3, so its 10-minute budget bought 11 steps of 500. So the training and data-generation settings that choose
bf16 accept `auto`, which asks `bf16_is_fast` for the device at hand.
"""

from __future__ import annotations

import functools
import logging
import time

import torch

log = logging.getLogger("draftsmith")

AUTO = "auto"
_TRUE = ("true", "1", "yes", "on", "bf16", "bfloat16")
_FALSE = ("false", "0", "no", "off", "fp32", "float32", "none")
# The probe's matmul: the shape of a small model's projection over a short batch (cheap in fp32: ~0.1 ms).
_PROBE_SHAPE = (128, 256, 256)
_PROBE_REPEATS = 3


def parse_bf16_setting(value: bool | str, field: str) -> bool | str:
    """A bf16 setting as True, False or AUTO; anything else is refused naming the field."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text == AUTO:
        return AUTO
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError(f"{field}: {value!r} is not true, false or {AUTO!r}")


def resolve_bf16(value: bool | str, device: torch.device | str, field: str) -> bool:
    """True where bf16 compute is to be used: `auto` measures the device (logged once); an explicit true on a
    device whose bf16 is slow is kept, with a warning saying by how much."""
    setting = parse_bf16_setting(value, field)
    kind = torch.device(device).type
    if setting is False:
        return False
    fast, ratio = _bf16_probe(kind)
    if setting == AUTO:
        return fast
    if not fast:
        log.warning("%s=true on a %s whose bf16 matmul is %.1fx slower than fp32: set it to %r or false",
                    field, kind, ratio, AUTO)
    return True


def bf16_is_fast(device: torch.device | str = "cpu") -> bool:
    """Whether a bf16 matmul beats fp32 on this device type (measured once per process)."""
    return _bf16_probe(torch.device(device).type)[0]


@functools.lru_cache(maxsize=None)
def _bf16_probe(kind: str) -> tuple[bool, float]:
    """(bf16 faster than fp32, bf16 time / fp32 time) for a device type."""
    if kind == "cuda":
        fast = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        log.info("bf16 on cuda: %s", "supported" if fast else "not supported")
        return fast, 1.0 if fast else float("inf")
    if kind != "cpu":
        return False, float("inf")
    times = {dtype: _matmul_seconds(dtype) for dtype in (torch.float32, torch.bfloat16)}
    ratio = times[torch.bfloat16] / times[torch.float32]
    fast = ratio < 1.0
    log.info("bf16 on this cpu: a matmul takes %.2fx its fp32 time, so `auto` bf16 settings are %s", ratio,
             "on" if fast else "off (fp32)")
    return fast, ratio


def _matmul_seconds(dtype: torch.dtype) -> float:
    m, k, n = _PROBE_SHAPE
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    a @ b   # first call: allocations, kernel choice
    best = float("inf")
    for _ in range(_PROBE_REPEATS):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return best
