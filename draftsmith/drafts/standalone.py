"""Standalone draft: a small Llama-family causal LM sharing the target's vocabulary and tokenizer.

On disk it is a plain HF ``LlamaForCausalLM`` directory (what vLLM's draft-model path and transformers'
assisted generation load). In memory it is our own module over flattened tokens, with parameter names
IDENTICAL to HF's (``model.embed_tokens``, ``model.layers.i.*``, ``model.norm``, ``lm_head``), so its
state_dict is an HF checkpoint and ``to_hf()`` / ``from_hf()`` are plain copies.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor, nn

from draftsmith.drafts.common import causal_attn_fn, copy_from_target, count_parameters, target_layer_pairs, target_layers
from draftsmith.kernels.layers.causal_lm import CausalLM, LMShape, lm_shape_from_hf
from draftsmith.kernels.layers.moe import fuse_expert_weights
from draftsmith.kernels.layers.checkpoint import read_state_dict
from draftsmith.kernels.layers.config import DecoderConfig, hf_config_dict


@dataclass
class StandaloneConfig:
    vocab_size: int
    num_hidden_layers: int
    decoder: DecoderConfig
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # A pretrained family checkpoint as the draft (e.g. a small Qwen3 for a Qwen3 target): its layer variants
    # (kernels.layers.family); None = plain Llama layers, what draftsmith trains and writes.
    variants: tuple | None = None

    def __post_init__(self) -> None:
        if isinstance(self.decoder, dict):
            self.decoder = DecoderConfig(**self.decoder)
        if self.vocab_size <= 0 or self.num_hidden_layers <= 0:
            raise ValueError(
                f"StandaloneConfig: vocab_size ({self.vocab_size}) and num_hidden_layers "
                f"({self.num_hidden_layers}) must be > 0"
            )

    @property
    def hidden_size(self) -> int:
        return self.decoder.hidden_size

    @classmethod
    def from_target_config(
        cls,
        target_cfg: Any,
        num_layers: int | None = None,
        hidden_size: int | None = None,
        intermediate_size: int | None = None,
        num_attention_heads: int | None = None,
        num_key_value_heads: int | None = None,
    ) -> "StandaloneConfig":
        """A smaller sibling of the target: same vocab, rope and head_dim; fewer layers (default L//4) and/or width.

        With a new hidden_size the head count follows as hidden_size // target head_dim unless given.
        """
        t = hf_config_dict(target_cfg)
        base = DecoderConfig.from_hf(t)
        layers = num_layers if num_layers is not None else max(1, int(t["num_hidden_layers"]) // 4)
        hidden = hidden_size or base.hidden_size
        heads = num_attention_heads or (base.num_attention_heads if hidden == base.hidden_size else max(1, hidden // base.head_dim))
        head_dim = base.head_dim if hidden == base.hidden_size else hidden // heads
        kv = num_key_value_heads or max(1, min(base.num_key_value_heads, heads))
        while heads % kv:
            kv -= 1
        ratio = base.intermediate_size / base.hidden_size
        decoder = DecoderConfig(
            **{
                **asdict(base),
                "hidden_size": hidden,
                "num_attention_heads": heads,
                "num_key_value_heads": kv,
                "head_dim": head_dim,
                "intermediate_size": intermediate_size or int(round(ratio * hidden)),
            }
        )
        return cls(
            vocab_size=int(t["vocab_size"]),
            num_hidden_layers=layers,
            decoder=decoder,
            tie_word_embeddings=bool(t.get("tie_word_embeddings", False)),
            bos_token_id=t.get("bos_token_id"),
            eos_token_id=t.get("eos_token_id"),
            pad_token_id=t.get("pad_token_id"),
        )

    @classmethod
    def from_hf(cls, cfg: Any) -> "StandaloneConfig":
        d = hf_config_dict(cfg)
        return cls(
            vocab_size=int(d["vocab_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            decoder=DecoderConfig.from_hf(d),
            variants=lm_shape_from_hf(d).variants,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"),
        )

    def to_hf_dict(self) -> dict:
        """config.json of the equivalent HF LlamaForCausalLM."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "num_hidden_layers": self.num_hidden_layers,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            **self.decoder.to_llama_dict(),
        }


class StandaloneDraft(CausalLM):
    """draftsmith.kernels.layers.CausalLM (the engine's own model) with a draft's config, init and HF interop;
    state_dict keys == HF LlamaForCausalLM keys."""

    kind = "standalone"

    def __init__(self, cfg: StandaloneConfig) -> None:
        super().__init__(LMShape(cfg.vocab_size, cfg.num_hidden_layers, cfg.decoder, cfg.tie_word_embeddings,
                                 cfg.variants))
        self.config = cfg
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    def forward_batch(self, input_ids: Tensor) -> Tensor:
        """Training API: input_ids [B, S] (causal, positions 0..S-1) -> logits [B, S, V]."""
        B, S = input_ids.shape
        positions = torch.arange(S, device=input_ids.device).repeat(B)
        hidden = self.forward(input_ids.reshape(-1), positions, causal_attn_fn(B, S))
        return self.compute_logits(hidden).view(B, S, -1)

    def num_parameters(self, trainable_only: bool = False) -> int:
        return count_parameters(self, trainable_only)

    # ---------------------------------------------------------------------------------------- HF interop

    def to_hf(self):
        """An equivalent transformers LlamaForCausalLM (same weights), e.g. for assisted generation."""
        from transformers import LlamaConfig, LlamaForCausalLM

        hf = LlamaForCausalLM(LlamaConfig(**self.config.to_hf_dict()))
        hf.load_state_dict(self.state_dict(), strict=True)
        return hf.to(next(self.parameters()).dtype)

    @classmethod
    def from_hf(cls, hf_model_or_dir: Any) -> "StandaloneDraft":
        """From a transformers LlamaForCausalLM object or an HF checkpoint dir (safetensors only)."""
        if isinstance(hf_model_or_dir, (str, Path)):
            cfg = StandaloneConfig.from_hf(hf_model_or_dir)
            state = read_state_dict(hf_model_or_dir)
        else:
            cfg = StandaloneConfig.from_hf(hf_model_or_dir.config)
            state = hf_model_or_dir.state_dict()
        draft = cls(cfg)
        state = fuse_expert_weights(state)  # per-expert checkpoint names -> stacked (MoE checkpoints only)
        if cfg.tie_word_embeddings:
            state = {k: v for k, v in state.items() if k != "lm_head.weight"}
        missing, unexpected = draft.load_state_dict(state, strict=False)
        missing = [k for k in missing if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"standalone checkpoint: missing weights {missing[:5]}, unexpected {unexpected[:5]}")
        return draft

    @classmethod
    def from_target_config(cls, target_cfg: Any, **opts: Any) -> "StandaloneDraft":
        return cls(StandaloneConfig.from_target_config(target_cfg, **opts))


def init_from_target(draft: StandaloneDraft, target_state: dict[str, Tensor] | str | Path, layer_ids: Sequence[int] | None = None) -> None:
    """Warm-start a standalone draft from the target: embeddings, final norm, LM head and the target layers
    ``layer_ids`` (default: the first ``draft.num_layers``; negative ids count from the target's last
    layer). Needs the same hidden size and layer shape;
    otherwise a ValueError names both sides' values.
    """
    state = read_state_dict(target_state) if isinstance(target_state, (str, Path)) else target_state
    layer_ids = list(layer_ids) if layer_ids is not None else list(range(draft.num_layers))
    layer_ids = target_layers(state, layer_ids, "init_from_target", count=draft.num_layers)
    own = draft.state_dict(keep_vars=True)
    pairs = [(own["model.embed_tokens.weight"], "model.embed_tokens.weight"),
             (own["model.norm.weight"], "model.norm.weight")]
    if not draft.config.tie_word_embeddings:
        pairs.append((own["lm_head.weight"], "lm_head.weight" if "lm_head.weight" in state else "model.embed_tokens.weight"))
    for dst, src in enumerate(layer_ids):
        pairs += target_layer_pairs(draft.model.layers[dst], src)
    copy_from_target(pairs, state, "init_from_target")
