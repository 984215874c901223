"""Sliding-window paged attention (Mistral / Qwen2 / Qwen3 layers whose config sets a window), in plain torch.

HF's rule (transformers.masking_utils.sliding_window_overlay): a query at position p sees keys at positions
k with p - window < k <= p. The cache keeps every key (blocks are not freed behind the window); this only
masks them, so prefix caching, swap and copy-on-write are unchanged. It serves every backend's windowed layers.

Positions come from the metadata alone: a new token's position is the prefix length plus the number of new
tokens it may attend, minus one. For causal rows that is seq_len - q_len + j; for a draft tree (verify rows)
it is prefix + depth, the rope position the engine gives each node, since a node sees the root and its ancestors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from draftsmith.kernels.attention import AttentionMetadata
from draftsmith.kernels.attention.torch_paged import gather_context


def window_mask(q_len: int, ctx_len: int, tree_rows: Tensor | None, window: int,
                device: torch.device) -> tuple[Tensor, int]:
    """(bool mask [q_len, ctx_len - start] True = may attend, start): keys before ``start`` are outside every
    query's window and are not gathered at all."""
    prefix = ctx_len - q_len
    if tree_rows is None:
        local = torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril_()
    else:
        local = tree_rows[:, :q_len].to(device=device, dtype=torch.bool)
    q_pos = prefix + local.sum(dim=1) - 1  # [q_len]
    k_pos = torch.cat([torch.arange(prefix, device=device), q_pos])  # [ctx_len]
    base = torch.cat([torch.ones(q_len, prefix, dtype=torch.bool, device=device), local], dim=1)
    mask = base & (k_pos[None, :] > q_pos[:, None] - window)
    start = max(0, min(int(q_pos.min()) - window + 1, prefix))
    return mask[:, start:], start


def sliding_window_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float,
                             window: int) -> Tensor:
    """q: [T, H, D]; k_cache/v_cache: [num_blocks, block_size, KVH, D] (new K/V already written) -> [T, H, D]."""
    out = torch.empty_like(q)
    cu = meta.cu_seqlens_q.tolist()
    for i, ctx_len in enumerate(meta.seq_lens.tolist()):
        lo, hi = cu[i], cu[i + 1]
        if hi == lo:
            continue
        tree_rows = meta.tree_mask[lo:hi] if meta.tree_mask is not None else None
        mask, start = window_mask(hi - lo, ctx_len, tree_rows, window, q.device)
        keys = gather_context(k_cache, meta.block_tables[i], ctx_len)[start:]  # [S, KVH, D]
        values = gather_context(v_cache, meta.block_tables[i], ctx_len)[start:]
        res = F.scaled_dot_product_attention(
            q[lo:hi].transpose(0, 1).unsqueeze(0),  # [1, H, L, D]
            keys.transpose(0, 1).unsqueeze(0),  # [1, KVH, S, D]
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=mask, scale=scale, enable_gqa=keys.shape[1] != q.shape[1])
        out[lo:hi] = res.squeeze(0).transpose(0, 1)
    return out
