"""A Llama-family causal LM over flattened tokens: the engine's target and the standalone draft are this class.

Parameter names are HF LlamaForCausalLM's (``model.embed_tokens``, ``model.layers.i.*``, ``model.norm``,
``lm_head``), so a state_dict is an HF checkpoint and loading one is a plain ``load_state_dict``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from draftsmith.kernels.layers.checkpoint import LM_HEAD, check_config
from draftsmith.kernels.layers.config import DecoderConfig
from draftsmith.kernels.layers.decoder import AttnFn, DecoderLayer, decoder_block
from draftsmith.kernels.layers.family import LayerVariant, layer_variants
from draftsmith.kernels.layers.linear import Linear
from draftsmith.kernels.layers.moe import fuse_expert_weights
from draftsmith.kernels.layers.native_draft_loop import DraftLoopSlot, NativeDraftLoop, loop_rope_table
from draftsmith.kernels.layers.native_stack import NativeStack
from draftsmith.kernels.layers.norm import RMSNorm
from draftsmith.kernels.layers.rope import RotaryEmbedding


def layer_attn(attn_fn: AttnFn | Sequence[AttnFn], layer_idx: int) -> AttnFn:
    """Multi-layer forwards take one attn_fn for all layers (stateless) or one per layer (caches)."""
    if callable(attn_fn):
        return attn_fn
    return attn_fn[layer_idx]


@dataclass(frozen=True)
class LMShape:
    vocab_size: int
    num_layers: int
    decoder: DecoderConfig
    tie_word_embeddings: bool = False
    # Per layer, how a target family's layer differs from Llama's (q/k norm, experts, window); None = plain Llama.
    variants: tuple[LayerVariant, ...] | None = None

    def variant(self, index: int) -> LayerVariant:
        return LayerVariant() if self.variants is None else self.variants[index]

    @property
    def sliding_windows(self) -> list[int | None]:
        """Attention window per layer (None = full attention)."""
        return [self.variant(i).sliding_window for i in range(self.num_layers)]


class Backbone(nn.Module):
    def __init__(self, shape: LMShape) -> None:
        super().__init__()
        d = shape.decoder.hidden_size
        self.embed_tokens = nn.Embedding(shape.vocab_size, d)
        self.layers = nn.ModuleList([DecoderLayer(shape.decoder, variant=shape.variant(i))
                                     for i in range(shape.num_layers)])
        self.norm = RMSNorm(d, shape.decoder.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, shape: LMShape) -> None:
        super().__init__()
        self.shape = shape
        self.model = Backbone(shape)
        self.lm_head = nn.Linear(shape.decoder.hidden_size, shape.vocab_size, bias=False)
        if shape.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(shape.decoder)
        self.serving_head: Linear | None = None  # serving form of lm_head (to_serving_)
        self.serving_norm: Callable[[Tensor], Tensor] | None = None  # serving form of the final norm
        self.native_stack: NativeStack | None = None  # every layer in one C call (to_serving_, native_stack)
        self._draft_loop = DraftLoopSlot()

    @property
    def num_layers(self) -> int:
        return self.shape.num_layers

    def run(self, input_ids: Tensor, positions: Tensor, attn_fn: AttnFn | Sequence[AttnFn],
            aux_layers: tuple[int, ...] = (), max_position: int | None = None) -> tuple[Tensor, dict[int, Tensor]]:
        """input_ids, positions [T] -> (final-norm hidden [T, d], {i: [T, d]} for i in aux_layers).

        aux_layers index HF ``hidden_states``: 0 = embeddings, i = output of layer i-1, L = final norm.
        max_position (largest position) spares the rope a device sync when the caller knows it.
        """
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, h.dtype, max_position)
        aux: dict[int, Tensor] = {0: h} if 0 in aux_layers else {}
        stack = self.native_stack
        if stack is not None and not callable(attn_fn) and stack.accepts(h, attn_fn):
            # the whole stack in one C call; HF's hidden_states[i + 1] is the stream after layer i
            h, after = stack(h, cos, sin, attn_fn, [i - 1 for i in aux_layers if 0 < i < self.num_layers])
            aux.update({index + 1: stream for index, stream in after.items()})
            return self._final(h, aux, aux_layers)
        for index, layer in enumerate(self.model.layers):
            ops = layer.serving_ops  # serving form: straight to the block, no nn.Module dispatch per layer
            attn = layer_attn(attn_fn, index)
            h = layer(h, cos, sin, attn) if ops is None else decoder_block(ops, h, cos, sin, attn)
            if index + 1 in aux_layers and index + 1 < self.num_layers:
                aux[index + 1] = h
        return self._final(h, aux, aux_layers)

    def _final(self, h: Tensor, aux: dict[int, Tensor], aux_layers: tuple[int, ...]) -> tuple[Tensor, dict[int, Tensor]]:
        hidden = self.model.norm(h) if self.serving_norm is None else self.serving_norm(h)
        if self.num_layers in aux_layers:
            aux[self.num_layers] = hidden  # HF's last hidden_states entry is the final-norm output
        return hidden, aux

    def forward(self, input_ids: Tensor, positions: Tensor, attn_fn: AttnFn | Sequence[AttnFn]) -> Tensor:
        """input_ids [T], positions [T] -> final-norm hidden [T, d]. attn_fn: one for all layers or one per layer."""
        return self.run(input_ids, positions, attn_fn)[0]

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """[N, d] -> [N, V] in the model dtype."""
        if self.serving_head is not None:
            return self.serving_head(hidden.to(self.serving_head.weight.dtype))
        return self.lm_head(hidden)

    def to_serving_(self, pack: bool | None = None) -> "CausalLM":
        """Serving form (inference only): every layer fused and packed, the head packed."""
        for layer in self.model.layers:
            layer.to_serving_(pack)
        self.serving_head = Linear.fuse([self.lm_head], pack, alias=not self.tied)
        self.serving_norm = self.model.norm.serving()
        self.native_stack = NativeStack.build(self.native_layers())
        self._draft_loop.clear()
        return self

    def native_layers(self) -> list:
        """Each layer's native form (None where it has none)."""
        return [None if layer.serving_ops is None else layer.serving_ops.native for layer in self.model.layers]

    def draft_loop(self) -> NativeDraftLoop | None:
        """Decode steps in one C call (kernels.layers.native_draft_loop), for a model in serving form whose layers
        and head are native; None otherwise."""
        return self._draft_loop.get(self._build_draft_loop)

    def _build_draft_loop(self) -> NativeDraftLoop | None:
        if not isinstance(self.serving_head, Linear):
            return None
        return NativeDraftLoop.build(self.native_stack or NativeStack.build(self.native_layers(), min_layers=1),
                                     self.model.embed_tokens.weight, self.model.norm.weight, self.model.norm.eps,
                                     self.serving_head.small, loop_rope_table(self.rotary))

    def repack(self, pack: bool) -> None:
        """Rebuild the serving form with packing on or off (torch.compile needs plain matmuls)."""
        self.to_serving_(pack)

    @property
    def tied(self) -> bool:
        return self.lm_head.weight is self.model.embed_tokens.weight

    def weight_bytes(self) -> int:
        """Bytes a decode step must read: every matrix once (the input embedding only as a tied lm_head)."""
        total = sum(p.numel() * p.element_size() for p in self.parameters())
        embed = self.model.embed_tokens.weight
        return total - (0 if self.tied else embed.numel() * embed.element_size())


def lm_shape_from_hf(config, tie_word_embeddings: bool | None = None) -> LMShape:
    """LMShape of an HF config (object or dict)."""
    from draftsmith.kernels.layers.config import hf_config_dict

    d = hf_config_dict(config)
    tied = bool(d.get("tie_word_embeddings", False)) if tie_word_embeddings is None else tie_word_embeddings
    variants = layer_variants(d)
    plain = all(v == LayerVariant() for v in variants)
    return LMShape(int(d["vocab_size"]), int(d["num_hidden_layers"]), DecoderConfig.from_hf(d), tied,
                   None if plain else variants)


def _hf_names(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Accept both 'model.layers...' (ForCausalLM) and bare 'layers...' (base model) names."""
    if any(k.startswith("model.") for k in state):
        return state
    return {k if k == LM_HEAD else "model." + k: v for k, v in state.items()}


def causal_lm_from_state_dict(config, state: dict[str, Tensor], dtype: torch.dtype, device: torch.device | str,
                              source: str = "state dict") -> CausalLM:
    """A CausalLM in its serving form from an HF config + state dict, without a random init.

    Built on the meta device, then the checkpoint's tensors (cast to dtype, moved to device) become the
    parameters; a missing lm_head means tied embeddings. Extra tensors (HF rotary buffers...) are ignored.
    """
    check_config(config, source)
    state = fuse_expert_weights(_hf_names(state))
    tied = bool(getattr(config, "tie_word_embeddings", False)) or LM_HEAD not in state
    with torch.device("meta"):
        model = CausalLM(lm_shape_from_hf(config, tie_word_embeddings=tied))
    own = model.state_dict()
    missing = sorted(k for k in own if k not in state and not (tied and k == LM_HEAD))
    if missing:
        raise ValueError(f"{source}: missing weight {missing[0]!r}" + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""))
    tensors = {k: state[k].to(device=device, dtype=dtype) for k in own if k in state and not (tied and k == LM_HEAD)}
    model.load_state_dict(tensors, strict=False, assign=True)
    if tied:  # assign replaced the embedding Parameter; point the head at the loaded one
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()
