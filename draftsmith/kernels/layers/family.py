"""What a target family changes in the plain Llama layer, per layer, read from its HF config.

Qwen3 adds a per-head RMSNorm on q and k (before rope); Qwen3-MoE (and Qwen2-MoE) replace the MLP of some layers
by top-k routed experts; Mistral / Qwen2 / Qwen3 configs may put a sliding attention window on some layers.
Drafts stay plain Llama layers: only the target's CausalLM reads these (``LMShape.variants``).
Anything a config asks for that this stack does not run is refused here, naming the config field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from draftsmith.kernels.layers.config import hf_config_dict

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe")
QK_NORM_TYPES = ("qwen3", "qwen3_moe")
MOE_TYPES = ("qwen3_moe", "qwen2_moe")
_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts of one sparse layer (HF Qwen3MoeSparseMoeBlock / Qwen2MoeSparseMoeBlock)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # per expert (moe_intermediate_size)
    norm_topk_prob: bool  # renormalise the top-k router probabilities to sum to 1
    shared_intermediate_size: int = 0  # Qwen2-MoE's always-on shared expert (0 = none), sigmoid-gated


@dataclass(frozen=True)
class LayerVariant:
    """How one target layer differs from the plain Llama layer (the default instance: not at all)."""

    qk_norm: bool = False
    moe: MoEConfig | None = None
    sliding_window: int | None = None  # keys older than this many positions are masked (None = full attention)


def _fail(source: str, field: str, why: str) -> ValueError:
    return ValueError(f"{source}: {field} {why}")


def sliding_windows(d: dict, source: str = "config") -> list[int | None]:
    """Per layer: the attention window, or None for full attention (transformers' rules for each family)."""
    num_layers = int(d["num_hidden_layers"])
    window = d.get("sliding_window")
    if d.get("model_type") in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe") and not d.get("use_sliding_window", False):
        window = None  # these configs carry a window that only use_sliding_window switches on
    if window is not None and int(window) <= 0:
        raise _fail(source, "sliding_window", f"must be > 0, got {window}")
    layer_types = d.get("layer_types")
    if layer_types is not None:
        bad = sorted(set(layer_types) - set(_LAYER_TYPES))
        if bad:
            raise _fail(source, "layer_types", f"entry {bad[0]!r} is not supported (only {_LAYER_TYPES})")
        if len(layer_types) != num_layers:
            raise _fail(source, "layer_types", f"has {len(layer_types)} entries for {num_layers} layers")
        if window is None and "sliding_attention" in layer_types:
            raise _fail(source, "layer_types", "names sliding_attention layers but sliding_window is unset")
        return [int(window) if t == "sliding_attention" else None for t in layer_types]
    if window is None:
        return [None] * num_layers
    first = int(d.get("max_window_layers", 0))
    if d.get("model_type") in ("qwen2", "qwen3"):  # Qwen2/3: the layers from max_window_layers on slide
        return [int(window) if i >= first else None for i in range(num_layers)]
    if d.get("model_type") == "qwen2_moe":  # Qwen2-MoE: every other layer below max_window_layers
        return [int(window) if (i + 1) % 2 and i < first else None for i in range(num_layers)]
    return [int(window)] * num_layers


def _moe_config(d: dict, source: str) -> MoEConfig:
    experts = int(d.get("num_experts", d.get("num_local_experts")) or 0)
    top_k = int(d.get("num_experts_per_tok", 0))
    if not 0 < top_k <= experts:
        raise _fail(source, "num_experts_per_tok", f"must be in [1, num_experts={experts}], got {top_k}")
    shared = int(d.get("shared_expert_intermediate_size", 0) or 0) if d.get("model_type") == "qwen2_moe" else 0
    return MoEConfig(experts, top_k, int(d["moe_intermediate_size"]), bool(d.get("norm_topk_prob", False)), shared)


def sparse_layers(d: dict, num_experts: int) -> list[bool]:
    """Which layers route to experts: not in mlp_only_layers and every decoder_sparse_step-th (HF's rule)."""
    step = int(d.get("decoder_sparse_step", 1) or 1)
    dense = set(d.get("mlp_only_layers") or [])
    return [num_experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(int(d["num_hidden_layers"]))]


def layer_variants(cfg: Any, source: str = "config") -> tuple[LayerVariant, ...]:
    """One LayerVariant per layer of a target config (object, dict or dir); ValueError naming the field."""
    d = hf_config_dict(cfg)
    model_type = d.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise _fail(source, "model_type", f"{model_type!r} is not one of {SUPPORTED_MODEL_TYPES}")
    windows = sliding_windows(d, source)
    moe = _moe_config(d, source) if model_type in MOE_TYPES else None
    sparse = sparse_layers(d, moe.num_experts) if moe else [False] * len(windows)
    qk_norm = model_type in QK_NORM_TYPES
    return tuple(LayerVariant(qk_norm, moe if is_sparse else None, window) for window, is_sparse in zip(windows, sparse))
