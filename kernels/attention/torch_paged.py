"""Reference paged attention in plain torch (CPU default, and the oracle the other backends are tested against).

Two paths:
- decode rows (one new token, no tree mask) of all sequences are served together: gather every such
  sequence's blocks padded to the longest context, mask the padding, one batched SDPA call;
- any other sequence (prefill chunk, several new tokens, tree verification) is served one at a time
  with SDPA over its gathered context and an explicit boolean mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kernels.attention import AttentionMetadata


def gather_context(cache: Tensor, block_table: Tensor, num_tokens: int) -> Tensor:
    """K or V of one sequence's first ``num_tokens`` positions.

    cache: [num_blocks, block_size, num_kv_heads, head_dim]; block_table: int [>= ceil(num_tokens/bs)].
    Returns [num_tokens, num_kv_heads, head_dim].
    """
    block_size = cache.shape[1]
    num_blocks = -(-num_tokens // block_size)
    blocks = cache.index_select(0, block_table[:num_blocks].long())
    return blocks.flatten(0, 1)[:num_tokens]


def query_mask(
    q_len: int, ctx_len: int, tree_rows: Tensor | None, device: torch.device
) -> Tensor:
    """Boolean [q_len, ctx_len] mask, True = may attend.

    The q_len new tokens are the last positions of the context. They all see the prefix before them;
    among themselves they follow causality, or ``tree_rows`` ([q_len, >= q_len], by local index) if given.
    """
    prefix = ctx_len - q_len
    mask = torch.ones(q_len, ctx_len, dtype=torch.bool, device=device)
    if tree_rows is not None:
        mask[:, prefix:] = tree_rows[:, :q_len].to(device=device, dtype=torch.bool)
    else:
        mask[:, prefix:] = torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril_()
    return mask


def _decode_batch(q: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor, key_mask: Tensor,
                  scale: float) -> Tensor:
    """One new token per sequence, all sequences at once.

    q: [B, H, D]; tables: int64 [B, nb] (blocks covering the longest context);
    key_mask: bool [B, 1, 1, nb * block_size], True where a key slot holds that sequence's context.
    Returns [B, H, D].
    """
    num_seqs, num_heads, head_dim = q.shape
    # [B, nb, bs, kvh, D] -> [B, kvh, S, D] with S = nb * bs; slots past seq_len are masked out.
    keys = k_cache[tables].flatten(1, 2).transpose(1, 2)
    values = v_cache[tables].flatten(1, 2).transpose(1, 2)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=key_mask, scale=scale,
                                         enable_gqa=keys.shape[1] != num_heads)
    return out.view(num_seqs, num_heads, head_dim)


def _one_sequence(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, ctx_len: int,
                  tree_rows: Tensor | None, scale: float) -> Tensor:
    """q: [L, H, D] new tokens at the end of a ctx_len context. Returns [L, H, D]."""
    q_len, num_heads, _ = q.shape
    keys = gather_context(k_cache, block_table, ctx_len)
    values = gather_context(v_cache, block_table, ctx_len)
    mask = query_mask(q_len, ctx_len, tree_rows, q.device)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),  # [1, H, L, D]
        keys.transpose(0, 1).unsqueeze(0),  # [1, kvh, S, D]
        values.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        scale=scale,
        enable_gqa=keys.shape[1] != num_heads,
    )
    return out.squeeze(0).transpose(0, 1)


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float) -> Tensor:
    """q: [T, H, D]; k_cache/v_cache: [num_blocks, block_size, kvh, D] (new K/V already written).

    Returns [T, H, D] in q's dtype.
    """
    if q.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(f"num_heads={q.shape[1]} is not a multiple of num_kv_heads={k_cache.shape[2]}")
    if meta.is_pure_decode:
        meta.prepare_decode(k_cache.shape[1])
        return _decode_batch(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_key_mask, scale)

    cu = meta.cu_seqlens_q.tolist()
    seq_lens = meta.seq_lens.tolist()
    out = torch.empty_like(q)
    # Sequences with a single new token and no tree mask still go through the batched decode path.
    decode_ids = [i for i in range(len(seq_lens)) if cu[i + 1] - cu[i] == 1] if meta.tree_mask is None else []
    if decode_ids:
        ids = torch.tensor(decode_ids, device=q.device)
        rows = meta.cu_seqlens_q[ids].long()
        block_size = k_cache.shape[1]
        num_blocks = -(-max(seq_lens[i] for i in decode_ids) // block_size)
        key_mask = torch.arange(num_blocks * block_size, device=q.device)[None, :] < meta.seq_lens[ids][:, None]
        out[rows] = _decode_batch(q[rows], k_cache, v_cache, meta.block_tables[ids, :num_blocks].long(),
                                  key_mask[:, None, None, :], scale)
    decode_set = set(decode_ids)
    for i, ctx_len in enumerate(seq_lens):
        if i in decode_set:
            continue
        start, end = cu[i], cu[i + 1]
        if end == start:
            continue
        tree_rows = meta.tree_mask[start:end] if meta.tree_mask is not None else None
        out[start:end] = _one_sequence(q[start:end], k_cache, v_cache, meta.block_tables[i], ctx_len,
                                       tree_rows, scale)
    return out
