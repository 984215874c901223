"""Reading HF Llama-family checkpoint dirs: config.json and safetensors weights (sharded or not).

The one reader of checkpoint tensors: the engine loads targets and standalone drafts with it, drafts read the
target's embedding and LM head with it, and drafts.identity hashes the files it lists.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # importing this module must not import torch (drafts.identity runs in light CLI paths)
    from torch import Tensor

from draftsmith.kernels.layers.family import SUPPORTED_MODEL_TYPES, layer_variants  # noqa: F401 (re-exported)
EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


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
    """ValueError naming the field when a config is not a Llama-family model this stack runs."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{source}: model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}")
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{source}: hidden_act {act!r} is not supported (SwiGLU with silu only)")
    if config.num_attention_heads % config.num_key_value_heads != 0:
        raise ValueError(f"{source}: num_attention_heads must be a multiple of num_key_value_heads")
    layer_variants(config, source)  # family fields (experts, windows, layer_types): refused here, by name


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards model.safetensors.index.json names, else every
    *.safetensors in the dir (sorted). ValueError when there are none or a named shard is missing."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map")
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index} names missing shard(s) {missing}")
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model dir {model_dir} has no *.safetensors weights (only safetensors checkpoints are read)")
    return files


def read_file(path: str | Path, names: Iterable[str] | None = None) -> dict[str, Tensor]:
    """Tensors of one safetensors file by name: all of them, or only ``names`` (the rest is never read)."""
    from safetensors import safe_open

    if not Path(path).is_file():
        raise ValueError(f"{path}: missing weights file")
    wanted = None if names is None else set(names)
    with safe_open(str(path), framework="pt") as f:
        return {key: f.get_tensor(key) for key in f.keys() if wanted is None or key in wanted}


def tensor_names(path: str | Path) -> set[str]:
    """Names in a safetensors file's header (no tensor is read); empty when the file does not exist."""
    from safetensors import safe_open

    if not Path(path).is_file():
        return set()
    with safe_open(str(path), framework="pt") as f:
        return set(f.keys())


def parameter_counts(model_dir: str | Path) -> dict[str, int]:
    """Elements per tensor of a checkpoint dir, from the headers alone (no tensor is read)."""
    from safetensors import safe_open

    counts: dict[str, int] = {}
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                n = 1
                for dim in f.get_slice(key).get_shape():
                    n *= int(dim)
                counts[key] = n
    return counts


def read_state_dict(model_dir: str | Path, names: Iterable[str] | None = None) -> dict[str, Tensor]:
    """Tensors of a checkpoint dir (all shards) by name: all of them, or only ``names``."""
    state: dict[str, Tensor] = {}
    for path in weight_files(model_dir):
        state.update(read_file(path, names))
    return state


def load_target_embed_and_head(model_dir: str | Path) -> tuple[Tensor, Tensor]:
    """(embed_tokens [V,d], lm_head [V,d]) of an HF Llama-family target; tied heads return the embedding twice."""
    tensors = read_state_dict(model_dir, [EMBED, LM_HEAD])
    if EMBED not in tensors:
        raise ValueError(f"{model_dir}: no {EMBED} in the checkpoint")
    return tensors[EMBED], tensors.get(LM_HEAD, tensors[EMBED])
