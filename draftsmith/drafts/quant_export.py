"""Export a quantized draft in compressed-tensors' ``pack-quantized`` layout (what vLLM's compressed-tensors
loader reads: W4A16 / W8A16 weight-only), and read that layout back.

Per quantized linear ``<name>``: ``<name>.weight_packed`` int32 [N, ceil(K * bits / 32)] (32 / bits values per
word, value j of a word at bits [j * bits, (j + 1) * bits), each stored as q + 2^(bits-1)), ``<name>.weight_scale``
[N, 1] (int8, channel strategy) or [N, K / g] (int4, group strategy), ``<name>.weight_shape`` int64 [2].
config.json carries ``quantization_config`` (quant_method compressed-tensors, symmetric int weights, targets
Linear, every linear left dense listed under ``ignore``). The values are ours (drafts.quant), so the export
dequantizes to exactly the weights our engine runs.

Layouts: a standalone draft becomes an HF ``LlamaForCausalLM`` dir (a vLLM draft model). Feature drafts keep
draftsmith's own config and tensor names (no serving engine has a quantized EAGLE/Medusa loader to match).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from draftsmith.drafts.files import write_json
from draftsmith.drafts.quant import QuantRecord
from draftsmith.kernels.quant import QuantizedLinear, dequantize, unpack_int4

QUANT_METHOD = "compressed-tensors"
FORMAT = "pack-quantized"


def pack_int32(q: Tensor, bits: int) -> Tensor:
    """Signed int values [N, K] -> int32 [N, ceil(K * bits / 32)] (compressed-tensors' dense packing; 32 % bits == 0)."""
    per_word = 32 // bits
    u = (q.to(torch.int64) + (1 << (bits - 1)))
    n, k = u.shape
    u = torch.nn.functional.pad(u, (0, (-k) % per_word)).view(n, -1, per_word)
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    words = (u << shifts).sum(dim=-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # two's complement view


def unpack_int32(packed: Tensor, bits: int, k: int) -> Tensor:
    """Inverse of pack_int32 -> int8 [N, k] signed values."""
    per_word = 32 // bits
    words = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    u = (words[..., None] >> shifts) & ((1 << bits) - 1)
    return (u.view(packed.shape[0], -1)[:, :k] - (1 << (bits - 1))).to(torch.int8)


def _signed_values(module: QuantizedLinear) -> Tensor:
    if module.scheme.bits == 8:
        return module.qweight.detach()
    return unpack_int4(module.qweight.detach()).to(torch.int8) - 8


def quantization_config(record: QuantRecord, ignore: list[str]) -> dict:
    cfg = record.config
    weights = {"num_bits": cfg.bits, "type": "int", "symmetric": True, "dynamic": False,
               "strategy": "channel" if cfg.bits == 8 else "group", "group_size": cfg.group_size}
    return {"quant_method": QUANT_METHOD, "format": FORMAT, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None, "output_activations": None}},
            "ignore": ignore, "kv_cache_scheme": None}


def compressed_state(model: torch.nn.Module) -> tuple[dict[str, Tensor], list[str]]:
    """The export's tensors (quantized linears packed, the rest as is) and the names of dense linears."""
    from draftsmith.drafts.io import draft_state_dict

    state = {k: v for k, v in draft_state_dict(model).items()}
    ignore = []
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            for suffix in ("qweight", "scales"):
                state.pop(f"{name}.{suffix}")
            scales = module.scales.detach()
            state[f"{name}.weight_packed"] = pack_int32(_signed_values(module), module.scheme.bits)
            state[f"{name}.weight_scale"] = scales[:, None] if module.scheme.bits == 8 else scales
            state[f"{name}.weight_shape"] = torch.tensor([module.out_features, module.in_features])
        elif isinstance(module, torch.nn.Linear):
            ignore.append(name)
    return state, ignore


def export_compressed(quant_dir: str | Path, out_dir: str | Path, verifier: str | None = None) -> Path:
    """Write the compressed-tensors export of a quantized draft dir; returns out_dir."""
    from draftsmith.drafts.export import EXPORT_META, resolve_verifier
    from draftsmith.drafts.io import load_draft, write_safetensors
    from draftsmith.drafts.kinds import CONFIG_FILE, WEIGHTS_FILE

    quant_dir, out = Path(quant_dir), Path(out_dir)
    record = QuantRecord.read(quant_dir)
    if record is None:
        raise ValueError(f"export: {quant_dir} is not a quantized draft (no quantization.json); run draftsmith quantize")
    loaded = load_draft(quant_dir)
    state, ignore = compressed_state(loaded.model)
    config = json.loads((quant_dir / CONFIG_FILE).read_text())
    config["quantization_config"] = quantization_config(record, ignore)
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / WEIGHTS_FILE, state)
    write_json(out / CONFIG_FILE, config)
    write_json(out / EXPORT_META, {"format": f"{QUANT_METHOD}/{FORMAT}", "kind": loaded.kind,
                                   "source": str(quant_dir.resolve()), "verifier": resolve_verifier(verifier),
                                   "quantization": record.config.label})
    return out


def read_compressed(export_dir: str | Path) -> dict[str, Tensor]:
    """A compressed-tensors export back as a dense state dict (fp32 weights) with the draft's tensor names."""
    from draftsmith.drafts.kinds import CONFIG_FILE, WEIGHTS_FILE
    from draftsmith.kernels.layers.checkpoint import read_file

    export_dir = Path(export_dir)
    qcfg = json.loads((export_dir / CONFIG_FILE).read_text()).get("quantization_config") or {}
    if qcfg.get("quant_method") != QUANT_METHOD or qcfg.get("format") != FORMAT:
        raise ValueError(f"{export_dir}: quantization_config is not {QUANT_METHOD}/{FORMAT}")
    bits = int(qcfg["config_groups"]["group_0"]["weights"]["num_bits"])
    state = read_file(export_dir / WEIGHTS_FILE)
    for key in [k for k in state if k.endswith(".weight_packed")]:
        name = key[: -len(".weight_packed")]
        _, k = state.pop(f"{name}.weight_shape").tolist()
        q = unpack_int32(state.pop(key), bits, k)
        scales = state.pop(f"{name}.weight_scale")
        state[f"{name}.weight"] = dequantize_signed(q, scales, bits)
    return state


def dequantize_signed(q: Tensor, scales: Tensor, bits: int) -> Tensor:
    """q int8 [N, K] signed, scales [N, 1] or [N, G] -> fp32 [N, K]."""
    if bits == 8:
        return dequantize(q, scales[:, 0], 8)
    group = q.shape[1] // scales.shape[1]
    return q.float() * scales.float().repeat_interleave(group, dim=1)
