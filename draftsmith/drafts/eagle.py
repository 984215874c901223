"""EAGLE-1 draft: one decoder layer autoregressive over the target's top-layer features.

Alignment (EAGLE's): the draft input at index i pairs feature f_i (target final-norm hidden at position i,
which predicts token x_{i+1}) with the embedding of x_{i+1}; ``fc([emb(x_{i+1}) ; f_i])`` (2d -> d) feeds one
Llama decoder layer WITHOUT input_layernorm (EAGLE drops it: fc's output is the residual stream), whose
output is the predicted feature f_{i+1}. Logits are ``target_lm_head(f_pred)`` with NO extra norm - EAGLE's
choice, because the regression target f is already the target's final-norm output. In a serving unroll,
step k > 0 feeds the draft's own predicted feature back as f.

embed_tokens and lm_head are frozen copies of the target's (``init_from_target``) and are saved with the
draft so a draft dir is self-contained; the fingerprint check at load time guards against a foreign target.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from draftsmith.drafts.common import (causal_attn_fn, copy_from_target, count_parameters, pass_through_, target_layer_pairs,
                           target_layers, unroll_ttt)
from draftsmith.kernels.layers.config import DecoderConfig, hf_config_dict
from draftsmith.kernels.layers.decoder import AttnFn, DecoderLayer, run_layer
from draftsmith.kernels.layers.linear import Linear
from draftsmith.kernels.layers.native_draft_loop import DraftLoopSlot, NativeDraftLoop, loop_rope_table
from draftsmith.kernels.layers.native_stack import NativeStack
from draftsmith.kernels.layers.rope import RotaryEmbedding


@dataclass
class EagleConfig:
    vocab_size: int
    decoder: DecoderConfig  # hidden_size == target hidden size (features are fed as-is)
    fc_bias: bool = False  # False as in vLLM speculators' EAGLE-1; HASS uses True

    def __post_init__(self) -> None:
        if isinstance(self.decoder, dict):
            self.decoder = DecoderConfig(**self.decoder)
        if self.vocab_size <= 0:
            raise ValueError(f"EagleConfig.vocab_size must be > 0, got {self.vocab_size}")

    @property
    def hidden_size(self) -> int:
        return self.decoder.hidden_size

    @classmethod
    def from_target_config(cls, target_cfg: Any, fc_bias: bool = False, **decoder_overrides: Any) -> "EagleConfig":
        """Decoder layer shaped like one target layer (hidden size is fixed by the target; the rest may be overridden)."""
        t = hf_config_dict(target_cfg)
        if "hidden_size" in decoder_overrides and decoder_overrides["hidden_size"] != t["hidden_size"]:
            raise ValueError(
                f"EAGLE-1 hidden_size must equal the target's ({t['hidden_size']}), got {decoder_overrides['hidden_size']}"
            )
        return cls(vocab_size=int(t["vocab_size"]), decoder=DecoderConfig.from_hf(t, **decoder_overrides), fc_bias=fc_bias)


class EagleDraft(nn.Module):
    kind = "eagle"
    num_layers = 1

    def __init__(self, cfg: EagleConfig) -> None:
        super().__init__()
        self.config = cfg
        d = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, d)
        self.fc = nn.Linear(2 * d, d, bias=cfg.fc_bias)
        self.layers = nn.ModuleList([DecoderLayer(cfg.decoder, input_norm=False)])
        self.lm_head = nn.Linear(d, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.decoder)
        self.serving_fc: Linear | None = None  # serving forms (to_serving_)
        self.serving_head: Linear | None = None
        self._draft_loop = DraftLoopSlot()
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        self.embed_tokens.weight.requires_grad_(False)
        self.lm_head.weight.requires_grad_(False)

    @classmethod
    def from_target_config(cls, target_cfg: Any, **opts: Any) -> "EagleDraft":
        return cls(EagleConfig.from_target_config(target_cfg, **opts))

    def init_from_target(self, embed: Tensor, lm_head: Tensor) -> None:
        """Copy the target's embedding [V, d] and lm_head [V, d] (both stay frozen)."""
        for name, src, dst in (("embed_tokens", embed, self.embed_tokens.weight), ("lm_head", lm_head, self.lm_head.weight)):
            if src.shape != dst.shape:
                raise ValueError(f"EAGLE init: target {name} is {tuple(src.shape)}, draft expects {tuple(dst.shape)}")
            with torch.no_grad():
                dst.copy_(src.to(dst.dtype))

    def init_layer_from_target(self, target_state: dict[str, Tensor], layer_id: int | None = None) -> None:
        """Warm-start the decoder layer from target layer `layer_id` (default: its last; negative from the end; EAGLE's layer has no
        input norm, so that weight is not taken) and `fc` as the identity on the feature half and zero on the
        embedding half, so the untrained draft applies the target's last layer to the feature it is given."""
        [src] = target_layers(target_state, [-1 if layer_id is None else layer_id], "EAGLE init")
        copy_from_target(target_layer_pairs(self.layers[0], src), target_state, "EAGLE init")
        pass_through_(self.fc, self.config.hidden_size)   # [emb ; f] -> f

    def forward(self, input_ids: Tensor, features: Tensor, positions: Tensor, attn_fn: AttnFn) -> Tensor:
        """input_ids [T] (x_{i+1}), features [T, d] (f_i or the draft's own prediction), positions [T]
        -> predicted next feature [T, d]."""
        fc = self.serving_fc or self.fc
        hidden = fc(torch.cat([self.embed_tokens(input_ids), features.to(self.fc.weight.dtype)], dim=-1))
        cos, sin = self.rotary(positions, hidden.dtype)
        return run_layer(self.layers[0], hidden, cos, sin, attn_fn)

    def compute_logits(self, predicted_features: Tensor) -> Tensor:
        return (self.serving_head or self.lm_head)(predicted_features)

    def to_serving_(self, pack: bool | None = None) -> "EagleDraft":
        """Serving form (inference only): the engine's fused, packed projections (kernels.layers)."""
        self.serving_fc = Linear.fuse([self.fc], pack)
        self.layers[0].to_serving_(pack)
        self.serving_head = Linear.fuse([self.lm_head], pack)
        self._draft_loop.clear()
        return self

    def draft_loop(self) -> NativeDraftLoop | None:
        """A chain's steps in one C call (kernels.layers.native_draft_loop: fc, the layer, the head, the token), for
        a draft in serving form whose projections and layer are native; None otherwise."""
        return self._draft_loop.get(self._build_draft_loop)

    def _build_draft_loop(self) -> NativeDraftLoop | None:
        ops = self.layers[0].serving_ops
        if not (isinstance(self.serving_fc, Linear) and isinstance(self.serving_head, Linear) and ops is not None):
            return None
        return NativeDraftLoop.build(NativeStack.build([ops.native], min_layers=1), self.embed_tokens.weight, None,
                                     0.0, self.serving_head.small, loop_rope_table(self.rotary),
                                     fc=self.serving_fc.small)

    def forward_batch(self, input_ids: Tensor, features: Tensor) -> tuple[Tensor, Tensor]:
        """Training API: input_ids [B, S], features [B, S, d] -> (predicted features [B,S,d], logits [B,S,V])."""
        B, S = input_ids.shape
        positions = torch.arange(S, device=input_ids.device).repeat(B)
        pred = self.forward(input_ids.reshape(-1), features.reshape(B * S, -1), positions, causal_attn_fn(B, S))
        return pred.view(B, S, -1), self.compute_logits(pred).view(B, S, -1)

    def ttt_forward(self, input_ids: Tensor, features: Tensor, num_steps: int) -> list[tuple[Tensor, Tensor]]:
        """Training-time-test unroll (HASS-style) over [B, S]: list of (predicted features, logits) per step."""
        outs = unroll_ttt(self.forward, input_ids, features, num_steps)
        return [(h, self.compute_logits(h)) for h in outs]

    def num_parameters(self, trainable_only: bool = False) -> int:
        return count_parameters(self, trainable_only)
