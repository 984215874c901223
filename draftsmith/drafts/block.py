"""Block-parallel draft (DFlash-style): K draft tokens from ONE non-causal forward of a few Llama layers.

Our own implementation from the published descriptions (DFlash; vLLM / speculators / SpecForge docs).

Context. The target's hidden states at ``aux_layers`` (HF ``hidden_states`` indexing, EAGLE-3's default choice
``[2, L//2, L-3]``) are concatenated per position ``[n, A * d_t]``, fused by ``fc`` and normalised by
``hidden_norm`` into one context row per target position. Every draft layer projects those rows through its own
``k_proj`` / ``v_proj`` (+ RoPE at the row's position) into its KV: the context is INJECTED as keys and values,
never run through the layers as queries ("KV injection").

Query block. For a root token x_r (the last emitted token, whose target features do not exist yet) the block is
``[x_r, mask_1, ..., mask_K]`` at positions r .. r + K: the root's embedding (the target's, frozen) and K learned
mask embeddings (one per block offset, or one shared: ``num_mask_tokens``). Every block token sees the whole
context (positions < r) and every other token of its block (bidirectional inside the block). The output at
offset j (1..K) goes through ``norm`` and the target's LM head (shared, frozen) and proposes x_{r+j}.

``block_size`` is the query block length the draft was trained with (K_max + 1). Serving always evaluates the
full trained block (the same attention pattern as training) and keeps the first K tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.drafts.common import _expand_kv, copy_from_target, count_parameters, target_layer_pairs, target_layers
from draftsmith.drafts.eagle3 import default_aux_layers
from draftsmith.kernels.attention import write_kv
from draftsmith.kernels.layers.config import DecoderConfig, hf_config_dict
from draftsmith.kernels.layers.decoder import AttnFn, DecoderLayer, OutRows, run_layer
from draftsmith.kernels.layers.linear import Linear
from draftsmith.kernels.layers.native_context_kv import NativeContextKV
from draftsmith.kernels.layers.native_stack import NativeStack
from draftsmith.kernels.layers.norm import RMSNorm
from draftsmith.kernels.layers.rope import RotaryEmbedding, apply_rope

KVRows = tuple[Tensor, Tensor]  # (k [n, kv, hd], v [n, kv, hd]) of one layer


@dataclass
class BlockConfig:
    vocab_size: int  # the target's vocabulary (the LM head is the target's)
    decoder: DecoderConfig  # hidden_size == the target's (shared embedding and LM head)
    target_hidden_size: int
    aux_layers: list[int] = field(default_factory=list)
    num_layers: int = 2
    block_size: int = 9  # query block length = 1 root + K_max masks
    num_mask_tokens: int | None = None  # None = block_size - 1 (one per offset); 1 = one shared mask
    fc_bias: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.decoder, dict):
            self.decoder = DecoderConfig(**self.decoder)
        if self.block_size < 2:
            raise ValueError(f"BlockConfig.block_size: {self.block_size} must be >= 2 (root + at least one mask)")
        if self.num_mask_tokens is None:
            self.num_mask_tokens = self.block_size - 1
        if self.num_mask_tokens not in (1, self.block_size - 1):
            raise ValueError(f"BlockConfig.num_mask_tokens: {self.num_mask_tokens} must be 1 or block_size - 1 = "
                             f"{self.block_size - 1}")
        if not self.aux_layers:
            raise ValueError("BlockConfig.aux_layers: name at least one target layer")
        if self.num_layers < 1:
            raise ValueError(f"BlockConfig.num_layers: {self.num_layers} must be >= 1")

    @property
    def hidden_size(self) -> int:
        return self.decoder.hidden_size

    @property
    def max_draft_tokens(self) -> int:
        return self.block_size - 1

    @classmethod
    def from_target_config(cls, target_cfg: Any, aux_layers: list[int] | None = None, num_layers: int = 2,
                           block_size: int = 9, num_mask_tokens: int | None = None, fc_bias: bool = False,
                           **decoder_overrides: Any) -> "BlockConfig":
        t = hf_config_dict(target_cfg)
        num_target_layers = int(t["num_hidden_layers"])
        layers = list(aux_layers) if aux_layers is not None else default_aux_layers(num_target_layers)
        check_aux_layers(layers, num_target_layers)
        if decoder_overrides.get("hidden_size", t["hidden_size"]) != t["hidden_size"]:
            raise ValueError(f"block draft hidden_size must equal the target's ({t['hidden_size']}): it shares the "
                             f"target's embedding and LM head")
        return cls(vocab_size=int(t["vocab_size"]), decoder=DecoderConfig.from_hf(t, **decoder_overrides),
                   target_hidden_size=int(t["hidden_size"]), aux_layers=layers, num_layers=num_layers,
                   block_size=block_size, num_mask_tokens=num_mask_tokens, fc_bias=fc_bias)


def check_aux_layers(layers: list[int], num_target_layers: int) -> None:
    """One line naming the layers and the limit when the target lacks some (HF hidden_states: 0..L)."""
    bad = [i for i in layers if not 0 <= int(i) <= num_target_layers]
    if bad:
        raise ValueError(f"block draft aux_layers {list(layers)}: {bad} outside 0..{num_target_layers} "
                         f"(the target has {num_target_layers} layers)")


def check_block_k(k: int, block_size: int) -> None:
    """A block draft proposes at most block_size - 1 tokens: more would need masks it never trained."""
    if k > block_size - 1:
        raise ValueError(f"block draft: K={k} is larger than the draft was trained for (at most "
                         f"block_size - 1 = {block_size - 1})")


def context_kv(layer: DecoderLayer, ctx: Tensor, cos: Tensor, sin: Tensor) -> KVRows:
    """Injected KV of one layer (training modules): ctx [n, d] -> k [n, kv, hd] (rope applied), v [n, kv, hd]."""
    attn = layer.self_attn
    kv_heads, hd = attn.shape.num_kv_heads, attn.shape.head_dim
    k = attn.k_proj(ctx).view(ctx.shape[0], kv_heads, hd)
    v = attn.v_proj(ctx).view(ctx.shape[0], kv_heads, hd)
    if cos.dtype != k.dtype:
        cos, sin = cos.to(k.dtype), sin.to(k.dtype)
    return apply_rope(k, cos, sin), v


class BlockDraft(nn.Module):
    kind = "block"

    def __init__(self, cfg: BlockConfig) -> None:
        super().__init__()
        self.config = cfg
        d = cfg.hidden_size
        self.num_layers = cfg.num_layers
        self.embed_tokens = nn.Embedding(cfg.vocab_size, d)
        self.mask_embeddings = nn.Parameter(torch.empty(cfg.num_mask_tokens, d))
        self.fc = nn.Linear(len(cfg.aux_layers) * cfg.target_hidden_size, d, bias=cfg.fc_bias)
        self.hidden_norm = RMSNorm(d, cfg.decoder.rms_norm_eps)
        self.layers = nn.ModuleList([DecoderLayer(cfg.decoder) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(d, cfg.decoder.rms_norm_eps)
        self.lm_head = nn.Linear(d, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.decoder)
        self.serving_fc: Linear | None = None  # serving forms (to_serving_)
        self.serving_head: Linear | None = None
        self.serving_kv: Linear | None = None   # every layer's [k ; v] injection projection: k of all, then v
        self.serving_norm = None
        self.serving_hidden_norm = None
        self.native_stack: NativeStack | None = None  # every layer in one C call (to_serving_)
        self.native_context: NativeContextKV | None = None  # the context injection in one C call (to_serving_)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        nn.init.normal_(self.mask_embeddings, std=0.02)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, frozen
        self.lm_head.weight.requires_grad_(False)

    @classmethod
    def from_target_config(cls, target_cfg: Any, **opts: Any) -> "BlockDraft":
        return cls(BlockConfig.from_target_config(target_cfg, **opts))

    @classmethod
    def check_state(cls, cfg: BlockConfig, state: dict[str, Tensor], source: str) -> None:
        """Load-time check (drafts.io): the stored mask embeddings must be the count the config declares."""
        masks = state.get("mask_embeddings")
        if masks is None or masks.dim() != 2 or masks.shape[0] != cfg.num_mask_tokens:
            have = None if masks is None else tuple(masks.shape)
            raise ValueError(f"{source}: mask_embeddings {have} do not match the config's num_mask_tokens="
                             f"{cfg.num_mask_tokens} (block_size={cfg.block_size})")

    def init_from_target(self, embed: Tensor, lm_head: Tensor) -> None:
        """Copy the target's embedding [V, d] and LM head [V, d] (both stay frozen)."""
        for name, src, dst in (("embed_tokens", embed, self.embed_tokens.weight), ("lm_head", lm_head, self.lm_head.weight)):
            if src.shape != dst.shape:
                raise ValueError(f"block draft init: target {name} is {tuple(src.shape)}, draft expects {tuple(dst.shape)}")
            with torch.no_grad():
                dst.copy_(src.to(dst.dtype))

    def init_layers_from_target(self, target_state: dict[str, Tensor], layer_ids: list[int] | None = None) -> None:
        """Warm-start the draft layers from target decoder layers (default: its last ``num_layers``) and ``norm``
        from the target's final norm (the frozen head was trained behind it).

        Why: a 1.5-minute budget trains ~100-250 steps; from random layers the block's offset-1 prediction
        barely uses the root token (measured on the embedded target: held-out offset-1 loss 0.17 warm vs 0.28
        cold at 110 steps, served T=0 tau 3.93 vs 3.79 over four domains)."""
        ids = list(layer_ids) if layer_ids is not None else list(range(-self.num_layers, 0))
        ids = target_layers(target_state, ids, "block draft init", count=self.num_layers)
        pairs = [(self.norm.weight, "model.norm.weight")]
        for layer, src in zip(self.layers, ids):
            pairs += target_layer_pairs(layer, src)
        copy_from_target(pairs, target_state, "block draft init")

    # ---------------------------------------------------------------------------------------- pieces

    def fuse(self, aux_hidden: Tensor) -> Tensor:
        """aux [..., A * d_t] (target layers in aux_layers order) -> context rows [..., d]."""
        fused = (self.serving_fc or self.fc)(aux_hidden.to(self.fc.weight.dtype))
        return (self.serving_hidden_norm or self.hidden_norm)(fused)

    def injected_kv(self, ctx: Tensor, positions: Tensor, max_position: int | None = None) -> list[KVRows]:
        """Context rows [n, d] at positions [n] (the largest: max_position, if the caller knows it) -> each
        layer's (k, v) [n, kv, hd]."""
        cos, sin = self.rotary(positions, ctx.dtype, max_position)
        if self.serving_kv is not None:
            return self._serving_kv(ctx, cos, sin)
        return [context_kv(layer, ctx, cos, sin) for layer in self.layers]

    def inject_context(self, aux: Tensor, positions: Tensor, max_position: int, caches: list[tuple[Tensor, Tensor]],
                       slots: Tensor) -> None:
        """Serving: context rows' aux hidden states [n, A d_t] at positions [n] into every layer's (k, v) cache
        [blocks, block_size, kv, hd] at slots int64 [n]. One C call where the native kernels serve it (the rows a
        round feeds), else fuse, injected_kv and one write per layer."""
        native_context = self.native_context
        if native_context is not None and native_context.accepts(aux, caches, slots):
            cos, sin = self.rotary(positions, torch.float32, max_position)
            native_context(aux, cos, sin, caches, slots)
            return
        kv = self.injected_kv(self.fuse(aux), positions, max_position)
        for (k, v), (k_cache, v_cache) in zip(kv, caches):
            write_kv(k, v, k_cache, v_cache, slots)

    def _serving_kv(self, ctx: Tensor, cos: Tensor, sin: Tensor) -> list[KVRows]:
        """Every layer's injected (k, v) from one projection [n, d] -> [n, (2 L kv) hd] (k of every layer, then v)
        and one rope call: per-layer projections cost a dispatch each for a round's one or two new rows."""
        attn = self.layers[0].self_attn
        kv_heads, hd, L = attn.shape.num_kv_heads, attn.shape.head_dim, self.num_layers
        kv = self.serving_kv(ctx).view(ctx.shape[0], 2 * L * kv_heads, hd)
        if cos.dtype != kv.dtype:
            cos, sin = cos.to(kv.dtype), sin.to(kv.dtype)
        k = apply_rope(kv[:, :L * kv_heads], cos, sin)
        v = kv[:, L * kv_heads:]
        return [(k[:, i * kv_heads:(i + 1) * kv_heads], v[:, i * kv_heads:(i + 1) * kv_heads]) for i in range(L)]

    def block_embeds(self, root_ids: Tensor, num_masks: int | None = None) -> Tensor:
        """root_ids [R] -> [R, 1 + M, d]: each block = [embed(root), mask_1 .. mask_M] (M = trained K_max)."""
        m = self.config.max_draft_tokens if num_masks is None else num_masks
        masks = self.mask_embeddings if self.config.num_mask_tokens > 1 else self.mask_embeddings.expand(m, -1)
        root = self.embed_tokens(root_ids)[:, None]  # [R, 1, d]
        return torch.cat([root, masks[:m].to(root.dtype)[None].expand(root.shape[0], -1, -1)], dim=1)

    def forward(self, hidden: Tensor, positions: Tensor, attn_fns: list[AttnFn], out_rows: OutRows = None,
                max_position: int | None = None) -> Tensor:
        """Block tokens hidden [T, d] at positions [T]; attn_fns one per layer (they hold the injected KV and the
        block mask) -> output hidden [T, d] (pre-norm), or only ``out_rows`` of it: the last layer then runs its
        o_proj and MLP on those rows alone (serving reads offsets 1..K, not the root or the masks past K).
        max_position: the largest position, where the caller knows it (spares the rope a sync)."""
        cos, sin = self.rotary(positions, hidden.dtype, max_position)
        stack = self.native_stack
        if stack is not None and stack.accepts(hidden, attn_fns):
            # every layer in one C call over all block rows; the last layer's o_proj and MLP run on the rows read
            # alone (at K=4 of a 9-row block: 4 of them)
            return stack(hidden, cos, sin, attn_fns, last_rows=row_indices(out_rows, hidden.shape[0]))[0]
        last = len(self.layers) - 1
        for i, (layer, attn) in enumerate(zip(self.layers, attn_fns)):
            hidden = run_layer(layer, hidden, cos, sin, attn, out_rows=out_rows if i == last else None)
        return hidden

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """-> target-vocabulary logits [..., V]."""
        if self.serving_head is not None:
            return self.serving_head(self.serving_norm(hidden))
        return self.lm_head(self.norm(hidden))

    def to_serving_(self, pack: bool | None = None) -> "BlockDraft":
        """Serving form (inference only): fused, packed projections; one injection matrix for every layer (each
        layer's k, then each layer's v); every layer in one C call where the native kernels serve the layers (up
        to the C layers' SMALL_GEMM_MAX_ROWS rows: 28 sequences of a 9-row block; more run the layers in torch)."""
        attns = [layer.self_attn for layer in self.layers]
        biased = attns[0].k_proj.bias is not None
        self.serving_kv = Linear(torch.cat([a.k_proj.weight for a in attns] + [a.v_proj.weight for a in attns]).detach(),
                                 torch.cat([a.k_proj.bias for a in attns] + [a.v_proj.bias for a in attns]).detach()
                                 if biased else None, pack)
        self.serving_fc = Linear.fuse([self.fc], pack)
        for layer in self.layers:
            layer.to_serving_(pack)
        self.native_stack = NativeStack.build([None if l.serving_ops is None else l.serving_ops.native
                                               for l in self.layers], min_layers=1)
        self.serving_norm = self.norm.serving()
        self.serving_hidden_norm = self.hidden_norm.serving()
        attn = attns[0].shape
        self.native_context = NativeContextKV.build(
            self.serving_fc.small if isinstance(self.serving_fc, Linear) else None, self.hidden_norm.weight,
            self.hidden_norm.eps, self.serving_kv.small, self.num_layers, attn.num_kv_heads, attn.head_dim)
        self.serving_head = Linear.fuse([self.lm_head], pack)
        return self

    # ---------------------------------------------------------------------------------------- training

    def anchor_forward(self, input_ids: Tensor, aux_hidden: Tensor, anchors: Tensor) -> Tensor:
        """Training API. input_ids [B, S], aux [B, S, A * d_t], anchors int64 [B, N] (block roots, >= 0).

        Block n of row b sits at positions anchors[b, n] + 0..K_max and sees the context rows at positions
        < anchors[b, n]. -> logits [B, N, K_max, V]: offset j (1..K_max) proposes x_{anchor + j}."""
        B, S = input_ids.shape
        N, width = anchors.shape[1], self.config.block_size
        ctx = self.fuse(aux_hidden).reshape(B * S, -1)
        kv = self.injected_kv(ctx, torch.arange(S, device=ctx.device).repeat(B))
        roots = input_ids.gather(1, anchors).reshape(-1)  # [B N]
        hidden = self.block_embeds(roots).reshape(B * N * width, -1)
        positions = (anchors[:, :, None] + torch.arange(width, device=anchors.device)).reshape(-1)
        mask = block_training_mask(anchors, S, width)  # [B, N W, S + N W]
        fns = [block_attn_fn(k.view(B, S, *k.shape[1:]), v.view(B, S, *v.shape[1:]), mask) for k, v in kv]
        out = self.forward(hidden, positions, fns).view(B, N, width, -1)
        return self.compute_logits(out[:, :, 1:])

    def num_parameters(self, trainable_only: bool = False) -> int:
        return count_parameters(self, trainable_only)


def row_indices(rows: OutRows, num_rows: int) -> Tensor | None:
    """out_rows as int64 indices (a slice of a 1-D range, or the index tensor itself); None for every row."""
    if rows is None:
        return None
    if isinstance(rows, slice):
        return torch.arange(num_rows)[rows]
    return rows


def block_training_mask(anchors: Tensor, seqlen: int, width: int) -> Tensor:
    """bool [B, N W, S + N W]: a block token sees context positions < its anchor and its own block only."""
    B, N = anchors.shape
    device = anchors.device
    ctx = torch.arange(seqlen, device=device)[None, None, :] < anchors[:, :, None]  # [B, N, S]
    ctx = ctx[:, :, None, :].expand(B, N, width, seqlen).reshape(B, N * width, seqlen)
    block_id = torch.arange(N, device=device).repeat_interleave(width)  # [N W]
    same = (block_id[:, None] == block_id[None, :])[None].expand(B, -1, -1)
    return torch.cat([ctx, same], dim=-1)


def block_attn_fn(ctx_k: Tensor, ctx_v: Tensor, mask: Tensor) -> AttnFn:
    """Training attention of one layer: block queries over [injected context KV ; block KV] under ``mask``.

    ctx_k/ctx_v [B, S, kv, hd]; mask bool [B, Q, S + Q] with Q = block tokens per row."""
    B, Q = mask.shape[0], mask.shape[1]

    def attn(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        heads, hd = q.shape[1], q.shape[2]
        keys = torch.cat([ctx_k, k.view(B, Q, *k.shape[1:])], dim=1)
        values = torch.cat([ctx_v, v.view(B, Q, *v.shape[1:])], dim=1)
        qb = q.view(B, Q, heads, hd).transpose(1, 2)
        kb = _expand_kv(keys, heads).transpose(1, 2)
        vb = _expand_kv(values, heads).transpose(1, 2)
        out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask[:, None], scale=hd ** -0.5)
        return out.transpose(1, 2).reshape(B * Q, heads, hd)

    return attn
