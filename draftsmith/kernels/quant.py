"""Weight-only INT8 (per output channel) and INT4 (grouped) linears, run with torch's own CPU int kernels.

Schemes (both symmetric, so they map 1:1 onto compressed-tensors' ``pack-quantized`` layout vLLM reads):

* int8: ``w[n, :] ~= q[n, :] * scale[n]``, q int8 in [-127, 127], scale = max|w[n]| / 127.
* int4: ``w[n, j] ~= (u[n, j] - 8) * scale[n, j // g]``, u in [0, 15] (q = u - 8 in [-8, 7]),
  scale = max|w| of the group / 7.5 (compressed-tensors' symmetric range), two u per byte (low nibble =
  even column) in ``qweight`` uint8 [N, K/2].

Runtime: ``torch._weight_int8pack_mm`` and ``torch._weight_int4pack_mm_for_cpu`` (the kernels torchao's CPU
int4 path wraps too) with bf16 activations on CPU. Elsewhere (fp32 / fp16 activations, CUDA) a serving linear
dequantizes ONCE at load and runs a dense GEMM: exact in what it computes, but without the memory saving; it
says so (``mode == "dequantized"`` and one warning). Measured at 1 thread: the fp32-activation int kernels
are 5-20x slower than a dense fp32 GEMM, hence bf16 only.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

BITS = (8, 4)
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what _weight_int4pack_mm_for_cpu accepts
INT4_RANGE = 7.5  # symmetric half-range: q in [-8, 7], as compressed-tensors computes int4 scales


@dataclass(frozen=True)
class QuantScheme:
    """How one linear's weight is stored: bit width and (int4) group size along the input dim."""

    bits: int
    group_size: int | None = None  # int4 only; int8 is per output channel

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise ValueError(f"quant.bits: {self.bits!r} is not supported; allowed values: {list(BITS)}")
        if self.bits == 4 and self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"quant.group_size: {self.group_size!r} is not supported for int4; "
                             f"allowed values: {list(INT4_GROUP_SIZES)}")
        if self.bits == 8 and self.group_size is not None:
            raise ValueError(f"quant.group_size: int8 is per output channel; leave it unset (null), got {self.group_size}")

    def check_width(self, in_features: int, name: str) -> None:
        """ValueError naming the layer when the group size does not divide its input width."""
        if self.bits == 4 and in_features % self.group_size:
            fits = [g for g in INT4_GROUP_SIZES if in_features % g == 0]
            raise ValueError(f"quant.group_size: {self.group_size} does not divide the input width {in_features} of "
                             f"{name}; allowed values for this layer: {fits}")


# ------------------------------------------------------------------------------------------- quantize math


def quantize_weight(weight: Tensor, scheme: QuantScheme) -> tuple[Tensor, Tensor]:
    """weight [N, K] float -> (qweight, scales fp32): int8 [N, K] + [N], or uint8 [N, K/2] + [N, K/g]."""
    w = weight.detach().float()
    if scheme.bits == 8:
        scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
        return torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8), scales
    n, k = w.shape
    scheme.check_width(k, "weight")
    groups = w.view(n, k // scheme.group_size, scheme.group_size)
    scales = (groups.abs().amax(dim=-1) / INT4_RANGE).clamp(min=1e-12)
    q = torch.round(groups / scales[..., None]).clamp(-8, 7).view(n, k)
    return pack_int4((q + 8).to(torch.uint8)), scales


def pack_int4(u: Tensor) -> Tensor:
    """uint8 [N, K] of values 0..15 -> uint8 [N, K/2]; column 2j in the low nibble, 2j+1 in the high."""
    return (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous()


def unpack_int4(packed: Tensor) -> Tensor:
    """uint8 [N, K/2] -> uint8 [N, K] of values 0..15 (inverse of pack_int4)."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).view(packed.shape[0], -1)


def dequantize(qweight: Tensor, scales: Tensor, bits: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """The dense weight [N, K] a quantized pair stands for (in fp32, then cast to dtype)."""
    s = scales.float()
    if bits == 8:
        return (qweight.float() * s[:, None]).to(dtype)
    q = unpack_int4(qweight).float() - 8
    group = q.shape[1] // s.shape[1]
    return (q * s.repeat_interleave(group, dim=1)).to(dtype)


# ------------------------------------------------------------------------------------ the module (on disk)


class QuantizedLinear(nn.Module):
    """A quantized nn.Linear: its state_dict (``qweight``, ``scales``, ``bias``) is what a draft dir stores.

    The int tensors are frozen Parameters, not buffers, so ``parameters()``-based byte counts (the engine's
    ``weight_bytes``) see the quantized size and ``.to(dtype)`` keeps them integer (it casts floats only:
    ``scales`` follow the draft's dtype, which is the activation dtype of the kernels).
    """

    is_quantized = True

    def __init__(self, in_features: int, out_features: int, scheme: QuantScheme, bias: bool = False) -> None:
        super().__init__()
        scheme.check_width(in_features, "linear")
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        if scheme.bits == 8:
            q = torch.zeros(out_features, in_features, dtype=torch.int8)
            s = torch.ones(out_features)
        else:
            q = torch.zeros(out_features, in_features // 2, dtype=torch.uint8)
            s = torch.ones(out_features, in_features // scheme.group_size)
        # scales first: code that probes a module's dtype with next(parameters()) (the Medusa proposer casts its
        # input features so) must find the activation dtype, not uint8
        self.scales = nn.Parameter(s, requires_grad=False)
        self.qweight = nn.Parameter(q, requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, scheme: QuantScheme, name: str = "linear") -> "QuantizedLinear":
        scheme.check_width(linear.in_features, name)
        out = cls(linear.in_features, linear.out_features, scheme, bias=linear.bias is not None)
        qweight, scales = quantize_weight(linear.weight, scheme)
        dtype = linear.weight.dtype
        with torch.no_grad():
            out.qweight.data, out.scales.data = qweight, scales.to(dtype)
            if linear.bias is not None:
                out.bias.data = linear.bias.detach().clone()
        return out

    @property
    def weight(self) -> Tensor:
        """The dense weight this stands for, in the scales' dtype (computed on each access: a reference)."""
        return dequantize(self.qweight, self.scales, self.scheme.bits, self.scales.dtype)

    def forward(self, x: Tensor) -> Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            raise ValueError("draft: a quantized draft cannot be trained (quantization: int8/int4 is inference "
                             "only); train the unquantized draft, then quantize it")
        return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bits={self.scheme.bits}, group={self.scheme.group_size}"


# --------------------------------------------------------------------------------------- the serving form


def kernel_mode(bits: int, dtype: torch.dtype, device: torch.device) -> tuple[str, str]:
    """(mode, reason): "int8-kernel"/"int4-kernel" where torch's CPU int kernels apply, else "dequantized"."""
    if device.type != "cpu":
        return "dequantized", f"no int{bits} weight-only kernel wired for {device.type}"
    if dtype != torch.bfloat16:
        return "dequantized", f"int kernels run with bfloat16 activations; the draft dtype is {dtype}"
    return f"int{bits}-kernel", "torch CPU kernel"


class QuantServingLinear:
    """draftsmith.kernels.layers.linear.Linear's interface (``__call__``, ``bias``, ``out_features``, ``nbytes``, ``weight``)
    over quantized weights.

    ``weight`` is a META tensor of the dense shape and activation dtype: callers read its dtype/shape to cast
    inputs, and nothing can read values that do not exist (in "dequantized" mode it is the real matrix)."""

    _warned: set[str] = set()

    def __init__(self, qweight: Tensor, scales: Tensor, bias: Tensor | None, scheme: QuantScheme) -> None:
        self.scheme, self.bias = scheme, None if bias is None else bias.detach()
        dtype, device = scales.dtype, qweight.device
        n = qweight.shape[0]
        k = qweight.shape[1] * (2 if scheme.bits == 4 else 1)
        self.mode, self.reason = kernel_mode(scheme.bits, dtype, device)
        self._n = n
        if self.mode == "dequantized":
            self.weight = dequantize(qweight, scales, scheme.bits, dtype)
            self._tensors: tuple[Tensor, ...] = (self.weight,)
            if self.reason not in QuantServingLinear._warned:  # one line per reason, not per layer
                QuantServingLinear._warned.add(self.reason)
                warnings.warn(f"quantized draft: dequantized at load ({self.reason}); weights use dense memory",
                              stacklevel=3)
            return
        self.weight = torch.empty(n, k, dtype=dtype, device="meta")
        if scheme.bits == 8:
            self._q, self._s = qweight.contiguous(), scales.contiguous()
            self._tensors = (self._q, self._s)
        else:
            self._q = torch._convert_weight_to_int4pack_for_cpu(unpack_int4(qweight).to(torch.int32), 8)
            # tinygemm computes (u - 8) * scale + zero per group: zero = 0 for a symmetric scheme
            self._s = torch.stack([scales, torch.zeros_like(scales)], dim=-1).transpose(0, 1).contiguous()
            self._tensors = (self._q, self._s)

    @property
    def out_features(self) -> int:
        return self._n

    def repack(self, pack: bool) -> None:
        """No-op: int weights have one layout (kept for the Linear interface)."""

    def __call__(self, x: Tensor) -> Tensor:
        if self.mode == "dequantized":
            return F.linear(x, self.weight, self.bias)
        if x.dim() != 2:
            return self(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self._n)
        x = x.to(self.weight.dtype).contiguous()  # the int4 kernel refuses strided rows (Medusa's head slices)
        if self.mode == "int8-kernel":
            y = torch._weight_int8pack_mm(x, self._q, self._s)
        else:
            y = torch._weight_int4pack_mm_for_cpu(x, self._q, self.scheme.group_size, self._s)
        return y if self.bias is None else y + self.bias

    def nbytes(self) -> int:
        """Bytes the forward reads: int weights + scales (+ bias), or the dense matrix when dequantized."""
        tensors = self._tensors if self.bias is None else (*self._tensors, self.bias)
        return sum(t.numel() * t.element_size() for t in tensors)


def fuse_quantized(linears: Sequence[nn.Module]) -> QuantServingLinear:
    """One serving linear over several quantized projections of one input (q/k/v, gate/up): rows concatenated
    (int8 scales are per row and int4 groups run along the input, so concatenating rows is exact)."""
    if not all(getattr(m, "is_quantized", False) for m in linears):
        raise ValueError("fused projections must all be quantized or none (quantize whole layers)")
    schemes = {m.scheme for m in linears}
    if len(schemes) != 1:
        raise ValueError(f"fused projections must share one quantization scheme, got {sorted(map(str, schemes))}")
    biases = [m.bias for m in linears]
    if any(b is None for b in biases) and not all(b is None for b in biases):
        raise ValueError("fused projections must all have a bias or none")
    qweight = torch.cat([m.qweight.detach() for m in linears], dim=0)
    scales = torch.cat([m.scales.detach() for m in linears], dim=0)
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases], dim=0)
    return QuantServingLinear(qweight, scales, bias, schemes.pop())
