"""The shape of a Llama-family decoder layer, read from any HF config (object, dict or checkpoint dir)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def hf_config_dict(cfg: Any) -> dict:
    """A target/draft config as a plain dict: accepts a PretrainedConfig, a dict, or a checkpoint dir/file."""
    if isinstance(cfg, dict):
        return dict(cfg)
    if isinstance(cfg, (str, Path)):
        path = Path(cfg)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise ValueError(f"target config: no config.json at {path}")
        return json.loads(path.read_text())
    if hasattr(cfg, "to_dict"):
        return cfg.to_dict()
    raise ValueError(f"target config: expected a PretrainedConfig, dict or path, got {type(cfg).__name__}")


def rope_settings(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either transformers-5 ``rope_parameters`` or the classic fields.

    rope_scaling is None for plain rope, else a dict with ``rope_type`` and that type's fields."""
    params = cfg.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling")
    if params and params.get("rope_type", params.get("type", "default")) != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling is not None and rope_type(scaling) == "default":
        scaling = None
    return theta, scaling


def rope_type(scaling: dict | None) -> str:
    """The rope type of a rope_scaling dict (older configs spell the key ``type``)."""
    return "default" if not scaling else scaling.get("rope_type", scaling.get("type", "default"))


@dataclass
class DecoderConfig:
    """Shape of one Llama-family decoder layer (the subset of an HF LlamaConfig a layer needs)."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    qkv_bias: bool = False  # Llama: attention_bias; Qwen2: always True
    o_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"DecoderConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"DecoderConfig: num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.hidden_act != "silu":
            raise ValueError(f"DecoderConfig.hidden_act: only 'silu' is supported, got {self.hidden_act!r}")

    @classmethod
    def from_hf(cls, cfg: Any, **overrides: Any) -> "DecoderConfig":
        d = hf_config_dict(cfg)
        theta, scaling = rope_settings(d)
        heads = int(d["num_attention_heads"])
        # Qwen2 always has q/k/v biases; Qwen2-MoE names them qkv_bias (default on)
        qkv_bias = (bool(d.get("attention_bias", False)) or d.get("model_type") == "qwen2"
                    or (d.get("model_type") == "qwen2_moe" and bool(d.get("qkv_bias", True))))
        o_bias = bool(d.get("attention_bias", False))
        fields = dict(
            hidden_size=int(d["hidden_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
            intermediate_size=int(d["intermediate_size"]),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(d.get("mlp_bias", False)),
            hidden_act=d.get("hidden_act", "silu"),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
        )
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def from_dict(cls, d: dict) -> "DecoderConfig":
        """From a saved dataclass dict; unknown keys (a newer or foreign writer's) are ignored."""
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})

    def to_llama_dict(self) -> dict:
        """The classic HF LlamaConfig fields (rope_theta/rope_scaling spelled the pre-v5 way: every reader knows it)."""
        if self.qkv_bias != self.o_bias:
            raise ValueError("to_llama_dict: Llama has one attention_bias flag; qkv_bias != o_bias cannot be expressed")
        return dict(
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            attention_bias=self.qkv_bias,
            mlp_bias=self.mlp_bias,
            hidden_act=self.hidden_act,
            max_position_embeddings=self.max_position_embeddings,
        )

    def rope_hf_config(self):
        """A transformers LlamaConfig carrying exactly the fields its rope init functions read."""
        from transformers import LlamaConfig

        return LlamaConfig(hidden_size=self.hidden_size, num_attention_heads=self.num_attention_heads,
                           num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                           max_position_embeddings=self.max_position_embeddings, rope_theta=self.rope_theta,
                           rope_scaling=dict(self.rope_scaling) if self.rope_scaling else None)
