"""EAGLE-3 draft: multi-layer feature fusion, own LM head over an optional reduced draft vocabulary.

Step 0: the target's hidden states at three layers (HF ``hidden_states`` indexing, default ``[2, L//2, L-3]``)
are concatenated ``[T, 3*d_t]`` and fused by ``fc`` (-> d). The midlayer normalises the token embedding
(``input_layernorm``) and the fused hidden (``hidden_norm``), concatenates them ``[T, 2d]`` into q/k/v, and
keeps the un-normalised hidden as the residual (``norm_before_residual=False``, as EAGLE-3/SGLang do).
Its output (pre-norm) is both the next step's hidden input and, through ``norm`` + ``lm_head``, the draft logits.
Step k > 0 feeds that own hidden back and skips ``fc`` - the "training-time test" unroll trains exactly that.

Pairing is EAGLE's: index i pairs the target features at position i with the embedding of x_{i+1}; the
logits at i predict x_{i+2}. ``d2t[j]`` is the OFFSET from draft id j to its target id (target = j + d2t[j],
SGLang/speculators convention); ``t2d`` is a bool mask over the target vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from draftsmith.drafts.common import causal_attn_fn, copy_from_target, count_parameters, pass_through_, target_layers, unroll_ttt
from draftsmith.kernels import native
from draftsmith.kernels.layers.config import DecoderConfig, hf_config_dict
from draftsmith.kernels.layers.decoder import AttnFn, DecoderLayer, mlp_residual, run_layer
from draftsmith.kernels.layers.linear import Linear
from draftsmith.kernels.layers.native_draft_loop import DraftLoopSlot, Eagle3Inputs, NativeDraftLoop, loop_rope_table
from draftsmith.kernels.layers.native_stack import NativeStack
from draftsmith.kernels.layers.norm import RMSNorm
from draftsmith.kernels.layers.rope import RotaryEmbedding


def default_aux_layers(num_target_layers: int) -> list[int]:
    """EAGLE-3's default feature layers [2, L//2, L-3] (HF hidden_states indexing: 0 = embeddings)."""
    return [2, num_target_layers // 2, num_target_layers - 3]


def build_reduced_vocab(token_counts: Tensor, size: int) -> tuple[Tensor, Tensor]:
    """The `size` most frequent target tokens as a draft vocabulary.

    token_counts [V_target] (any numeric dtype). Returns d2t int64 [size] (offsets: target id = draft id +
    d2t[draft id]) and t2d bool [V_target]. Draft ids follow ascending target id; ties go to the lower id.
    """
    counts = torch.as_tensor(token_counts).flatten().double()
    vocab = counts.numel()
    if not 0 < size <= vocab:
        raise ValueError(f"build_reduced_vocab: size must be in 1..{vocab} (target vocab), got {size}")
    # stable sort on -count keeps the lower id first among equal counts
    chosen = torch.sort(torch.sort(-counts, stable=True).indices[:size]).values
    d2t = chosen - torch.arange(size)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    return d2t.long(), t2d


@dataclass
class Eagle3Config:
    vocab_size: int  # target vocabulary
    decoder: DecoderConfig
    target_hidden_size: int
    aux_layers: list[int] = field(default_factory=list)
    draft_vocab_size: int | None = None  # None = full target vocabulary
    norm_before_residual: bool = False
    fc_bias: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.decoder, dict):
            self.decoder = DecoderConfig(**self.decoder)
        if self.draft_vocab_size is None:
            self.draft_vocab_size = self.vocab_size
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(
                f"Eagle3Config.draft_vocab_size must be in 1..vocab_size={self.vocab_size}, got {self.draft_vocab_size}"
            )
        if len(self.aux_layers) != 3:
            raise ValueError(f"Eagle3Config.aux_layers must name 3 target layers, got {self.aux_layers}")

    @property
    def hidden_size(self) -> int:
        return self.decoder.hidden_size

    @classmethod
    def from_target_config(
        cls,
        target_cfg: Any,
        aux_layers: list[int] | None = None,
        draft_vocab_size: int | None = None,
        norm_before_residual: bool = False,
        fc_bias: bool = False,
        **decoder_overrides: Any,
    ) -> "Eagle3Config":
        t = hf_config_dict(target_cfg)
        num_layers = int(t["num_hidden_layers"])
        layers = list(aux_layers) if aux_layers is not None else default_aux_layers(num_layers)
        bad = [i for i in layers if not 0 <= i <= num_layers]
        if bad:
            raise ValueError(f"Eagle3 aux_layers {layers}: {bad} outside 0..{num_layers} (target num_hidden_layers)")
        return cls(
            vocab_size=int(t["vocab_size"]),
            decoder=DecoderConfig.from_hf(t, **decoder_overrides),
            target_hidden_size=int(t["hidden_size"]),
            aux_layers=layers,
            draft_vocab_size=draft_vocab_size,
            norm_before_residual=norm_before_residual,
            fc_bias=fc_bias,
        )


class Eagle3MidLayer(DecoderLayer):
    """Decoder layer whose attention reads [input_layernorm(emb) ; hidden_norm(hidden)] (2d)."""

    def __init__(self, cfg: DecoderConfig, norm_before_residual: bool = False) -> None:
        super().__init__(cfg, attn_input_size=2 * cfg.hidden_size, input_norm=True)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm_before_residual = norm_before_residual
        self.serving_hidden_norm = None

    def forward(self, embeds: Tensor, hidden: Tensor, cos: Tensor, sin: Tensor, attn_fn: AttnFn) -> Tensor:  # type: ignore[override]
        """embeds, hidden [T, d]; cos, sin [T, 1, D] -> [T, d]."""
        ops = self.ops
        normed = (self.serving_hidden_norm or self.hidden_norm)(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([ops.input_norm(embeds), normed], dim=-1)
        if ops.native is not None and ops.native.accepts(residual, attn_fn) and native.eligible(x):  # one C call
            return ops.native(residual, cos, sin, attn_fn, attn_input=x)
        return mlp_residual(ops, residual + ops.attention(x, cos, sin, attn_fn))

    def to_serving_(self, pack: bool | None = None) -> "Eagle3MidLayer":
        super().to_serving_(pack)
        self.serving_hidden_norm = self.hidden_norm.serving()
        return self


class Eagle3Draft(nn.Module):
    kind = "eagle3"
    num_layers = 1

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.config = cfg
        d = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, d)
        self.fc = nn.Linear(3 * cfg.target_hidden_size, d, bias=cfg.fc_bias)
        self.midlayer = Eagle3MidLayer(cfg.decoder, cfg.norm_before_residual)
        self.norm = RMSNorm(d, cfg.decoder.rms_norm_eps)
        self.lm_head = nn.Linear(d, cfg.draft_vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.decoder)
        self.serving_fc: Linear | None = None  # serving forms (to_serving_)
        self.serving_head: Linear | None = None
        self.serving_norm = None
        self._draft_loop = DraftLoopSlot()
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[: cfg.draft_vocab_size] = True  # identity map until set_vocab_map
        self.register_buffer("t2d", t2d)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        self.embed_tokens.weight.requires_grad_(False)  # the target's embedding, frozen

    @classmethod
    def from_target_config(cls, target_cfg: Any, **opts: Any) -> "Eagle3Draft":
        return cls(Eagle3Config.from_target_config(target_cfg, **opts))

    def init_from_target(self, embed: Tensor, lm_head: Tensor | None = None) -> None:
        """Copy the target's embedding; with lm_head given, seed the draft head with the target rows it keeps."""
        if tuple(embed.shape) != tuple(self.embed_tokens.weight.shape):
            raise ValueError(f"EAGLE-3 init: target embedding is {tuple(embed.shape)}, draft expects {tuple(self.embed_tokens.weight.shape)}")
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embed.to(self.embed_tokens.weight.dtype))
            if lm_head is not None:
                self.lm_head.weight.copy_(lm_head[self.draft_to_target_ids(torch.arange(self.config.draft_vocab_size))].to(self.lm_head.weight.dtype))

    def init_layer_from_target(self, target_state: dict[str, Tensor], layer_id: int | None = None) -> None:
        """Warm-start the mid layer from target layer `layer_id` (default: its last; negative from the end) and `norm` from the final
        norm. The attention reads [norm(emb) ; norm(hidden)] (2d): q/k/v take the target's weights on the hidden
        half and zero on the embedding half, both norms the target layer's input norm; `fc` passes the last
        aux layer through, so the untrained draft runs the target's last layer on that feature (with
        norm_before_residual, on its normed form)."""
        [src] = target_layers(target_state, [-1 if layer_id is None else layer_id], "EAGLE-3 init")
        layer, d = self.midlayer, self.config.hidden_size
        if self.config.target_hidden_size != d:
            raise ValueError(f"EAGLE-3 init: the draft width {d} differs from the target's "
                             f"{self.config.target_hidden_size}; nothing to copy")
        wide = {f"self_attn.{p}_proj.weight" for p in "qkv"}
        own = layer.state_dict(keep_vars=True)
        prefix = f"model.layers.{src}"
        pairs = [(t, f"{prefix}.{name}") for name, t in own.items() if name not in wide | {"hidden_norm.weight"}]
        pairs += [(layer.hidden_norm.weight, f"{prefix}.input_layernorm.weight"), (self.norm.weight, "model.norm.weight")]
        pairs += [(own[name][:, d:], f"{prefix}.{name}") for name in sorted(wide)]
        with torch.no_grad():
            for name in wide:
                own[name].zero_()
        copy_from_target(pairs, target_state, "EAGLE-3 init")
        pass_through_(self.fc, 2 * d)   # the last of the three aux layers

    def set_vocab_map(self, d2t: Tensor, t2d: Tensor) -> None:
        """Install a reduced vocabulary (from ``build_reduced_vocab``); shapes and consistency are checked."""
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise ValueError(
                f"set_vocab_map: d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)} do not match the draft's "
                f"{tuple(self.d2t.shape)} / {tuple(self.t2d.shape)}"
            )
        target_ids = torch.arange(d2t.numel()) + d2t.cpu()
        if int(t2d.sum()) != d2t.numel() or not bool(t2d.cpu()[target_ids].all()):
            raise ValueError("set_vocab_map: t2d does not mark exactly the target ids named by d2t")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    # ---------------------------------------------------------------------------------------- forward

    def fuse(self, aux_hidden: Tensor) -> Tensor:
        """aux_hidden [..., 3*d_t] (target layers concatenated in aux_layers order) -> [..., d]."""
        return (self.serving_fc or self.fc)(aux_hidden.to(self.fc.weight.dtype))

    def forward(self, input_ids: Tensor, hidden_in: Tensor, positions: Tensor, attn_fn: AttnFn) -> Tensor:
        """input_ids [T] (x_{i+1}), hidden_in [T, d] (``fuse(aux)`` at step 0, the draft's own output after),
        positions [T] -> hidden_out [T, d] (pre-norm; feed back as next hidden_in)."""
        embeds = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, embeds.dtype)
        return run_layer(self.midlayer, embeds, hidden_in, cos, sin, attn_fn)

    def compute_logits(self, hidden_out: Tensor) -> Tensor:
        """-> logits over the DRAFT vocabulary [..., draft_vocab_size]."""
        if self.serving_head is not None:
            return self.serving_head(self.serving_norm(hidden_out))
        return self.lm_head(self.norm(hidden_out))

    def to_serving_(self, pack: bool | None = None) -> "Eagle3Draft":
        """Serving form (inference only): the engine's fused, packed projections (kernels.layers)."""
        self.serving_fc = Linear.fuse([self.fc], pack)
        self.midlayer.to_serving_(pack)
        self.serving_norm = self.norm.serving()
        self.serving_head = Linear.fuse([self.lm_head], pack)
        self._draft_loop.clear()
        return self

    def draft_loop(self) -> NativeDraftLoop | None:
        """A chain's steps in one C call (kernels.layers.native_draft_loop: the two input norms, the mid layer, the
        final norm, the head over the draft vocabulary, the token through d2t), for a draft in serving form whose
        layer and head are native; None otherwise."""
        return self._draft_loop.get(self._build_draft_loop)

    def _build_draft_loop(self) -> NativeDraftLoop | None:
        layer = self.midlayer
        native_layer = None if layer.serving_ops is None else layer.serving_ops.native
        # (a monotone d2t keeps the first of equal maxima the one torch's argmax over target ids picks)
        if (native_layer is None or native_layer.input_norm is None or not isinstance(self.serving_head, Linear)
                or not bool((self.d2t[1:] >= self.d2t[:-1]).all())):
            return None
        inputs = Eagle3Inputs.of(native_layer.input_norm, layer.hidden_norm.weight, layer.hidden_norm.eps,
                                 layer.norm_before_residual)
        return NativeDraftLoop.build(NativeStack.build([native_layer], min_layers=1, reads_hidden=False),
                                     self.embed_tokens.weight, self.norm.weight, self.norm.eps, self.serving_head.small,
                                     loop_rope_table(self.rotary), eagle3=inputs, d2t=self.d2t)

    def draft_to_target_ids(self, draft_ids: Tensor) -> Tensor:
        return draft_ids + self.d2t.to(draft_ids.device)[draft_ids]

    def to_target_logits(self, draft_logits: Tensor) -> Tensor:
        """Scatter draft-vocab logits into the target vocab; tokens outside the draft vocab get -inf."""
        return self.to_target_vocab(draft_logits, float("-inf"))

    def to_target_vocab(self, draft_rows: Tensor, fill: float) -> Tensor:
        """Scatter rows over the draft vocab [..., draft V] into the target vocab [..., V], `fill` outside it (-inf
        for logits, 0 for probabilities)."""
        out = draft_rows.new_full((*draft_rows.shape[:-1], self.config.vocab_size), fill)
        ids = self.draft_to_target_ids(torch.arange(self.config.draft_vocab_size, device=draft_rows.device))
        out[..., ids] = draft_rows
        return out

    def forward_batch(self, input_ids: Tensor, aux_hidden: Tensor) -> tuple[Tensor, Tensor]:
        """Training API (step 0 only): input_ids [B,S], aux_hidden [B,S,3*d_t] -> (hidden_out, draft logits)."""
        B, S = input_ids.shape
        positions = torch.arange(S, device=input_ids.device).repeat(B)
        out = self.forward(input_ids.reshape(-1), self.fuse(aux_hidden).reshape(B * S, -1), positions, causal_attn_fn(B, S))
        return out.view(B, S, -1), self.compute_logits(out).view(B, S, -1)

    def ttt_forward(self, input_ids: Tensor, aux_hidden: Tensor, num_steps: int) -> list[tuple[Tensor, Tensor]]:
        """Training-time test over [B, S]: (hidden_out, draft logits) per step; step j at index i predicts
        x_{i+2+j} after j steps on its own hidden states (see ``draftsmith.drafts.common.unroll_ttt``)."""
        outs = unroll_ttt(self.forward, input_ids, self.fuse(aux_hidden), num_steps)
        return [(h, self.compute_logits(h)) for h in outs]

    def num_parameters(self, trainable_only: bool = False) -> int:
        return count_parameters(self, trainable_only)
