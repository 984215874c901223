"""Load a Llama-family HF checkpoint (config.json + safetensors, sharded or not) into fused tensors.

Fusion at load time: q/k/v projections become one [(H + 2 KVH) * D, d] matrix and gate/up one
[2 I, d] matrix, so a layer runs 4 matmuls instead of 7.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass
class LayerWeights:
    input_norm: Tensor  # [d]
    qkv: Tensor  # [(H + 2 KVH) * D, d]
    qkv_bias: Tensor | None  # [(H + 2 KVH) * D] (Qwen2-style attention bias) or None
    o_proj: Tensor  # [d, H * D]
    o_bias: Tensor | None  # [d] or None
    post_norm: Tensor  # [d]
    gate_up: Tensor  # [2 I, d]
    down: Tensor  # [d, I]


@dataclass
class ModelWeights:
    embed: Tensor  # [V, d]
    layers: list[LayerWeights]
    norm: Tensor  # [d]
    lm_head: Tensor  # [V, d]; the same storage as embed when embeddings are tied
    tied: bool


def load_config(model_dir: str | Path):
    """HF config of a checkpoint dir; ValueError if it is missing or not Llama-family."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ValueError(f"model dir {model_dir} has no config.json")
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    check_config(config, source=str(model_dir / "config.json"))
    return config


def check_config(config, source: str = "config") -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{source}: model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}")
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{source}: hidden_act {act!r} is not supported (SwiGLU with silu only)")
    if config.num_attention_heads % config.num_key_value_heads != 0:
        raise ValueError(f"{source}: num_attention_heads must be a multiple of num_key_value_heads")


def read_state_dict(model_dir: str | Path) -> dict[str, Tensor]:
    """All tensors of a checkpoint dir: the shards named by model.safetensors.index.json, else every *.safetensors."""
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map")
        files = sorted({model_dir / name for name in weight_map.values()})
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model dir {model_dir} has no *.safetensors weights")
    state: dict[str, Tensor] = {}
    for path in files:
        if not path.is_file():
            raise ValueError(f"{index} names missing shard {path.name}")
        state.update(load_file(str(path)))
    return state


def _strip_prefix(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Accept both 'model.layers...' (ForCausalLM) and bare 'layers...' (base model) names."""
    if any(k.startswith("model.") for k in state):
        return {k[len("model."):] if k.startswith("model.") else k: v for k, v in state.items()}
    return state


def fuse_weights(config, state: dict[str, Tensor], dtype: torch.dtype, device: torch.device | str,
                 source: str = "state dict") -> ModelWeights:
    """Turn HF parameter names into fused, contiguous tensors of ``dtype`` on ``device``."""
    state = _strip_prefix(state)

    def take(name: str, required: bool = True) -> Tensor | None:
        tensor = state.get(name)
        if tensor is None:
            if required:
                raise ValueError(f"{source}: missing weight {name!r}")
            return None
        return tensor.to(device=device, dtype=dtype)

    def cat(*tensors: Tensor | None) -> Tensor | None:
        if all(t is None for t in tensors):
            return None
        if any(t is None for t in tensors):
            raise ValueError(f"{source}: q/k/v biases must be all present or all absent")
        return torch.cat(tensors, dim=0).contiguous()

    layers = []
    for i in range(config.num_hidden_layers):
        p = f"layers.{i}."
        layers.append(LayerWeights(
            input_norm=take(p + "input_layernorm.weight"),
            qkv=cat(*(take(p + f"self_attn.{n}_proj.weight") for n in "qkv")),
            qkv_bias=cat(*(take(p + f"self_attn.{n}_proj.bias", required=False) for n in "qkv")),
            o_proj=take(p + "self_attn.o_proj.weight").contiguous(),
            o_bias=take(p + "self_attn.o_proj.bias", required=False),
            post_norm=take(p + "post_attention_layernorm.weight"),
            gate_up=cat(take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")),
            down=take(p + "mlp.down_proj.weight").contiguous(),
        ))
    embed = take("embed_tokens.weight").contiguous()
    lm_head = take("lm_head.weight", required=False)
    tied = bool(getattr(config, "tie_word_embeddings", False)) or lm_head is None
    if tied:
        lm_head = embed
    return ModelWeights(embed=embed, layers=layers, norm=take("norm.weight"), lm_head=lm_head, tied=tied)


def weight_bytes(weights: ModelWeights) -> int:
    """Bytes a decode step must read: every matrix once (a tied embedding counts once, as the lm_head)."""
    tensors = [weights.lm_head, weights.norm]
    for layer in weights.layers:
        tensors += [layer.input_norm, layer.qkv, layer.qkv_bias, layer.o_proj, layer.o_bias, layer.post_norm,
                    layer.gate_up, layer.down]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
