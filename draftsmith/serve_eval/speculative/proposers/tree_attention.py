"""Attention for one depth of an incrementally drafted tree, over the draft's own paged cache.

A tree depth feeds the draft only its NEW frontier nodes. Their context is the sequence's committed draft
entries (true features, all visible) followed by the tree entries written at earlier depths, of which a node
may see only its ancestors and itself (EAGLE-2's tree attention). The engine's paged kernels cannot express
that: they let query tokens see all earlier context and mask only among the query tokens. So this step
gathers each sequence's context from the paged cache (committed + tree entries, padded to the longest
sequence) and runs one batched SDPA with an explicit mask. The K/V of the new nodes is written into their
slots first, so the next depth finds it there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from draftsmith.kernels.attention import write_kv
from draftsmith.kernels.layers.decoder import AttnFn


@dataclass(frozen=True)
class TreeStepLayout:
    """Where one depth's new nodes sit in the paged cache and what each of them may attend to."""

    slot_mapping: Tensor  # int64 [T]: cache slot of each new node's K/V (flattened, sequence after sequence)
    key_slots: Tensor  # int64 [B, S]: cache slot of every context entry of each sequence (padding: any slot)
    mask: Tensor  # bool [B, Q, S]: query j of sequence b may see key s (padded query rows see key 0 only)
    query_index: Tensor | None  # int64 [T]: row of each new node in the padded [B * Q]; None = no padding

    @classmethod
    def build(cls, block_tables: Sequence[list[int]], block_size: int, num_committed: Sequence[int],
              tree_masks: Sequence[Tensor], device: torch.device | str) -> TreeStepLayout:
        """tree_masks[b]: bool [q_b, t_b] over sequence b's t_b tree entries (the new q_b nodes are the last
        q_b of them); its context is its num_committed[b] committed entries followed by those t_b entries."""
        query_lens = [int(m.shape[0]) for m in tree_masks]
        ctx_lens = [c + int(m.shape[1]) for c, m in zip(num_committed, tree_masks)]
        batch, width, num_queries = len(tree_masks), max(ctx_lens), max(query_lens)
        for table, ctx in zip(block_tables, ctx_lens):
            if len(table) * block_size < ctx:
                raise ValueError(f"draft tree step: block table of {len(table)} blocks cannot hold {ctx} entries")
        widest = max(len(t) for t in block_tables)
        tables = torch.tensor([t + [t[-1]] * (widest - len(t)) for t in block_tables], dtype=torch.int64)
        positions = torch.arange(width)
        columns = (positions // block_size).clamp_max(widest - 1).expand(batch, -1)
        key_slots = tables.gather(1, columns) * block_size + positions % block_size  # [B, S]
        mask = torch.zeros(batch, num_queries, width, dtype=torch.bool)
        new_slots = []
        for b, (committed, ctx, q, tree) in enumerate(zip(num_committed, ctx_lens, query_lens, tree_masks)):
            mask[b, :q, :committed] = True
            mask[b, :q, committed:ctx] = tree
            mask[b, q:, 0] = True  # padding rows: a finite softmax, output discarded
            new_slots.append(key_slots[b, ctx - q:ctx])
        query_index = None
        if min(query_lens) != num_queries:
            query_index = torch.cat([b * num_queries + torch.arange(q) for b, q in enumerate(query_lens)])
            query_index = query_index.to(device)
        return cls(torch.cat(new_slots).to(device), key_slots.to(device), mask.to(device), query_index)


def tree_attn_fn(k_cache: Tensor, v_cache: Tensor, layout: TreeStepLayout, scale: float) -> AttnFn:
    """The attn_fn of a kernels.layers forward over the new nodes: q [T, H, D], k/v [T, KVH, D] -> [T, H, D]."""
    batch, width = layout.key_slots.shape
    num_queries = layout.mask.shape[1]
    flat_slots = layout.key_slots.reshape(-1)

    def attn(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        write_kv(k, v, k_cache, v_cache, layout.slot_mapping)
        kv_heads, head_dim = k_cache.shape[-2:]
        num_heads = q.shape[1]
        keys = k_cache.view(-1, kv_heads, head_dim).index_select(0, flat_slots).view(batch, width, kv_heads, head_dim)
        values = v_cache.view(-1, kv_heads, head_dim).index_select(0, flat_slots).view(batch, width, kv_heads, head_dim)
        if layout.query_index is None:
            queries = q.view(batch, num_queries, num_heads, head_dim)
        else:
            queries = q.new_zeros(batch * num_queries, num_heads, head_dim)
            queries[layout.query_index] = q
            queries = queries.view(batch, num_queries, num_heads, head_dim)
        out = F.scaled_dot_product_attention(
            queries.transpose(1, 2), keys.transpose(1, 2).to(q.dtype), values.transpose(1, 2).to(q.dtype),
            attn_mask=layout.mask[:, None], scale=scale, enable_gqa=kv_heads != num_heads)  # [B, H, Q, D]
        out = out.transpose(1, 2).reshape(batch * num_queries, num_heads, head_dim)
        return out if layout.query_index is None else out.index_select(0, layout.query_index)

    return attn
