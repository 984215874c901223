"""The attention callables drafts train and test with (the model layers themselves are kernels.layers).

Every draft runs kernels.layers modules over a FLATTENED token axis ``[T, d]`` with explicit ``positions [T]``
and a pluggable ``attn_fn(q [T,h,hd], k [T,kv,hd], v [T,kv,hd]) -> [T,h,hd]``. The caller decides what the
tokens attend to:

* training: ``causal_attn_fn(batch, seqlen)`` - plain causal SDPA over a ``[B, S]`` batch flattened to ``B*S``;
* serving: ``draftsmith.kernels.attention.paged_attn_fn`` over a paged cache (the proposer's job);
* tests / simple unrolls: ``DenseKVCache`` - one sequence, contiguous cache, append + causal attend;
* EAGLE "training-time test": ``TTTAttention`` - step 0 attends causally, later steps also see their own
  earlier-step keys on the diagonal, exactly what a serving unroll sees (see ``unroll_ttt``).

The attention scale is always ``head_dim ** -0.5`` (Llama), so closures derive it from ``q.shape[-1]``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from draftsmith.kernels.layers.decoder import AttnFn

# ------------------------------------------------------------------------------------- attention closures


def _expand_kv(x: Tensor, num_heads: int) -> Tensor:
    # [..., kv, hd] -> [..., h, hd]; kv head g serves query heads g*rep .. (g+1)*rep-1 (HF repeat_kv order)
    rep = num_heads // x.shape[-2]
    return x if rep == 1 else x.repeat_interleave(rep, dim=-2)


def causal_attn_fn(batch: int, seqlen: int) -> AttnFn:
    """Causal SDPA over a [batch, seqlen] batch whose tokens were flattened row-major to T = batch*seqlen."""

    def attn(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        heads, hd = q.shape[1], q.shape[2]
        qb = q.view(batch, seqlen, heads, hd).transpose(1, 2)
        kb = _expand_kv(k.view(batch, seqlen, k.shape[1], hd), heads).transpose(1, 2)
        vb = _expand_kv(v.view(batch, seqlen, v.shape[1], hd), heads).transpose(1, 2)
        out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=hd**-0.5)
        return out.transpose(1, 2).reshape(batch * seqlen, heads, hd)

    return attn


class DenseKVCache:
    """One sequence, contiguous per-layer K/V: append the new tokens, attend causally. For tests and simple unrolls."""

    def __init__(self, num_layers: int) -> None:
        self.keys: list[Tensor | None] = [None] * num_layers
        self.values: list[Tensor | None] = [None] * num_layers

    @property
    def num_tokens(self) -> int:
        return 0 if self.keys[0] is None else int(self.keys[0].shape[0])

    def truncate(self, num_tokens: int) -> None:
        """Roll back to the first num_tokens cached tokens (rejected drafts)."""
        for i in range(len(self.keys)):
            if self.keys[i] is not None:
                self.keys[i] = self.keys[i][:num_tokens]
                self.values[i] = self.values[i][:num_tokens]

    def attn_fns(self) -> list[AttnFn]:
        return [self._layer_fn(i) for i in range(len(self.keys))]

    def _layer_fn(self, layer_idx: int) -> AttnFn:
        def attn(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            if self.keys[layer_idx] is not None:
                k = torch.cat([self.keys[layer_idx], k])
                v = torch.cat([self.values[layer_idx], v])
            self.keys[layer_idx], self.values[layer_idx] = k, v
            num_new, num_ctx, heads, hd = q.shape[0], k.shape[0], q.shape[1], q.shape[2]
            # new token j sits at context index num_ctx - num_new + j and sees indices <= that
            visible = torch.arange(num_ctx, device=q.device)[None, :] <= (
                torch.arange(num_new, device=q.device)[:, None] + num_ctx - num_new
            )
            qh, kh, vh = q.transpose(0, 1), _expand_kv(k, heads).transpose(0, 1), _expand_kv(v, heads).transpose(0, 1)
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=visible, scale=hd**-0.5)
            return out.transpose(0, 1)

        return attn


class TTTAttention:
    """EAGLE "training-time test" attention over a [batch, seqlen] batch unrolled for several steps.

    Step 0 keys are attended causally. A query at index i of step j also sees the keys of steps 1..j at the
    SAME index i (the diagonal) - exactly the keys a serving unroll that started right after index i has
    produced by its j-th draft step. With positions ``arange(S) + j`` at step j (see ``unroll_ttt``) the
    rotary offsets also match serving, so step j at index i equals a serving unroll token for token.
    """

    def __init__(self, batch: int, seqlen: int, num_layers: int) -> None:
        self.batch, self.seqlen = batch, seqlen
        self.keys: list[list[Tensor]] = [[] for _ in range(num_layers)]
        self.values: list[list[Tensor]] = [[] for _ in range(num_layers)]

    def attn_fns(self) -> list[AttnFn]:
        return [self._layer_fn(i) for i in range(len(self.keys))]

    def _layer_fn(self, layer_idx: int) -> AttnFn:
        def attn(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            B, S, heads, hd = self.batch, self.seqlen, q.shape[1], q.shape[2]
            self.keys[layer_idx].append(_expand_kv(k.view(B, S, -1, hd), heads))  # [B,S,h,hd]
            self.values[layer_idx].append(_expand_kv(v.view(B, S, -1, hd), heads))
            qb = q.view(B, S, heads, hd) * hd**-0.5
            k0, v0 = self.keys[layer_idx][0], self.values[layer_idx][0]
            causal = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
            scores0 = torch.einsum("bihd,bjhd->bhij", qb, k0).masked_fill(~causal, float("-inf"))
            diag = [(qb * ks).sum(-1).permute(0, 2, 1)[..., None] for ks in self.keys[layer_idx][1:]]  # [B,h,S,1]
            probs = torch.softmax(torch.cat([scores0, *diag], dim=-1).float(), dim=-1).to(q.dtype)
            out = torch.einsum("bhij,bjhd->bihd", probs[..., :S], v0)
            for step, vs in enumerate(self.values[layer_idx][1:]):
                out = out + probs[..., S + step].permute(0, 2, 1)[..., None] * vs
            return out.reshape(B * S, heads, hd)

        return attn


def unroll_ttt(
    step_fn: Callable[[Tensor, Tensor, Tensor, Any], Tensor],
    input_ids: Tensor,
    hidden_in: Tensor,
    num_steps: int,
    num_layers: int = 1,
    pad_token_id: int = 0,
) -> list[Tensor]:
    """Run an EAGLE draft for num_steps training-time-test steps over a [B, S] batch.

    step_fn(input_ids [T], hidden_in [T,d], positions [T], attn_fn) -> hidden_out [T,d] is the draft's flat forward.
    input_ids [B,S]: input_ids[b, i] is the token paired with feature i (already shifted by one). Step j uses
    the tokens shifted left by j (teacher tokens stand in for the draft's own samples) and the previous step's
    hidden_out as its hidden input. Returns hidden_out [B,S,d] per step; step j at index i predicts the token
    j steps after step 0's target, and indices i >= S - j see padding - mask them in the loss.
    """
    if num_steps < 1:
        raise ValueError(f"unroll_ttt: num_steps must be >= 1, got {num_steps}")
    B, S = input_ids.shape
    cache = TTTAttention(B, S, num_layers)
    fns = cache.attn_fns()
    attn = fns[0] if num_layers == 1 else fns
    outputs: list[Tensor] = []
    ids, hidden = input_ids, hidden_in
    for step in range(num_steps):
        positions = (torch.arange(S, device=input_ids.device) + step).repeat(B)
        hidden = step_fn(ids.reshape(-1), hidden.reshape(B * S, -1), positions, attn).view(B, S, -1)
        outputs.append(hidden)
        ids = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], pad_token_id)], dim=1)
    return outputs


# ------------------------------------------------------------------------------------------------ helpers


def target_layers(target_state: dict[str, Tensor], layer_ids: list[int], what: str, count: int | None = None) -> list[int]:
    """`layer_ids` as indices of the target's decoder layers (negative ids count from its last), checked to
    exist (and to be `count` of them): a ValueError names them as given, the target's depth and `what`."""
    num_target = 1 + max((int(k.split(".")[2]) for k in target_state if k.startswith("model.layers.")), default=-1)
    resolved = [i + num_target if i < 0 else i for i in layer_ids]
    if not all(0 <= i < num_target for i in resolved) or (count is not None and len(resolved) != count):
        need = "" if count is None else f"{count} of "
        raise ValueError(f"{what}: layer ids {list(layer_ids)} must name {need}the target's {num_target} layers "
                         "(negative from the end)")
    return resolved


def target_layer_pairs(layer: nn.Module, target_layer: int, prefix: str = "model.layers") -> list[tuple[Tensor, str]]:
    """(draft tensor, target weight name) for every weight of a draft decoder `layer` taken from the target's
    layer `target_layer`: the names match because both are kernels.layers DecoderLayers. A weight the draft
    layer lacks (EAGLE-1 has no input norm) is simply not asked for."""
    return [(t, f"{prefix}.{target_layer}.{name}") for name, t in layer.state_dict(keep_vars=True).items()]


def pass_through_(fc: nn.Linear, start: int) -> None:
    """Set `fc` [d_out, d_in] to pick input columns start .. start + d_out unchanged (identity there, zero
    elsewhere): a warm start that feeds one of the fused inputs straight through."""
    d = fc.weight.shape[0]
    with torch.no_grad():
        fc.weight.zero_()
        fc.weight[:, start:start + d].copy_(torch.eye(d, dtype=fc.weight.dtype))


def copy_from_target(pairs: list[tuple[Tensor, str]], target_state: dict[str, Tensor], what: str) -> None:
    """Copy target weights by name into draft tensors (warm starts); a missing weight or a shape that differs
    is a ValueError naming it, both shapes and `what` is being initialised."""
    with torch.no_grad():
        for dst, name in pairs:
            if name not in target_state:
                raise ValueError(f"{what}: the target has no weight {name!r}")
            if tuple(target_state[name].shape) != tuple(dst.shape):
                raise ValueError(f"{what}: {name} is {tuple(target_state[name].shape)} in the target, "
                                 f"{tuple(dst.shape)} in the draft; widths must match to copy layers")
            dst.copy_(target_state[name].to(dst.dtype))


def count_parameters(module: nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)
