"""Reference paged attention in plain torch (CPU default, and the oracle the other backends are tested against).

Two paths:
- decode rows (one new token, no tree mask) of all sequences are served together, and so are short
  causal blocks after a prefix (a chain's verify rows, at most ``MAX_BATCHED_QUERY_ROWS`` tokens). Once per forward a
  ``DecodePlan`` (shared by every layer) sorts them by context length into a few length buckets and
  precomputes, per bucket, the row index of each (sequence, kv head, position) in the flat cache and an
  additive padding mask. Each layer then gathers K and V with one ``index_select`` each straight into
  the head-major [B*KVH, S, D] layout a batched GEMV wants, and runs two ``baddbmm``/``bmm`` calls;
  buckets keep padding (wasted reads) small when context lengths differ a lot. A bucket of L-token
  blocks folds the L rows into the query-head axis and its mask adds causality inside the block;
- any other sequence (prefill chunk, long blocks, tree verification) is served one at a time
  with SDPA over its gathered context (``is_causal`` when it has no prefix, else an explicit mask).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from draftsmith.kernels.attention import AttentionMetadata, native_paged

# Bucketing cost model, in "key positions" (one sequence's K and V at one position): every extra bucket costs
# about this many positions' worth of fixed per-op work (~8 small ops per layer), measured on a 2-core CPU.
_BUCKET_OVERHEAD_POSITIONS = 256
_MAX_BUCKET_CUTS = 16  # candidate cut points considered (keeps planning O(B) in Python)
# Padded widths are rounded up to a multiple of this (and of the block size): oneDNN builds a new GEMM primitive
# for every new shape (~0.7 ms for a bf16 bmm here), so a width that grew by one token each step would pay that
# on every step; rounding makes shapes repeat for many steps at the cost of a few masked positions.
_WIDTH_GRANULE = 32
_SMALL_BUCKET_ROWS = 4096  # gathered (sequence, kv head, position) rows up to which bf16/fp16 buckets run in fp32
# Causal blocks up to this many new tokens after a prefix join the batched path (K+1 verify rows of a chain);
# longer ones (prefill chunks) have enough rows per sequence for SDPA's own kernel.
MAX_BATCHED_QUERY_ROWS = 16


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


@dataclass
class _Bucket:
    """Sequences of similar context length with the same number L of new tokens, padded to the longest."""

    query_rows: Tensor | None  # int64 [B_b * L] rows of q/out; None = all rows, in order
    cache_rows: Tensor  # int64 [B_b * KVH * S_b] rows of the cache viewed as [slots * KVH, D]
    bag_rows: Tensor  # int64 [B_b * H * L, S_b] the same rows per (query head, new token): V's embedding_bag input
    # fp32 0 / -inf: [B_b * KVH, 1, S_b] on padding when L = 1 (None = no padding), else
    # [B_b * KVH, group * L, S_b] on padding and on the block's later tokens
    key_bias: Tensor | None
    num_seqs: int
    width: int  # S_b = longest context in the bucket, rounded up to _WIDTH_GRANULE
    q_len: int = 1  # L


@dataclass
class DecodePlan:
    """Per-forward precomputation of the batched decode path (same for every layer)."""

    key: tuple  # (block_size, num_kv_heads, num_heads): another layout (e.g. a draft's) rebuilds
    buckets: list[_Bucket]
    # Additive attention masks (0 / -inf, in q's dtype) of the multi-token sequences (chunked prefill, verify
    # rows, trees) by batch index, built on the first layer and reused by the others (None = plain causal, SDPA
    # is_causal). Additive, because SDPA turns a boolean mask into this very tensor on every call.
    extend_masks: dict[int, Tensor | None] = field(default_factory=dict)
    batched_seqs: frozenset[int] = frozenset()  # batch indices the buckets serve (mixed batches)
    # The metadata's seq_lens and cu_seqlens_q as Python lists, read once per forward, not once per layer.
    seq_lens: list[int] = field(default_factory=list)
    cu_seqlens_q: list[int] = field(default_factory=list)


def _bucket_bounds(sorted_lens: list[int]) -> list[tuple[int, int]]:
    """Split lengths sorted ascending into contiguous buckets minimizing sum(count * max) + overhead per bucket.

    Exact DP over at most _MAX_BUCKET_CUTS candidate cut points (quantiles), so planning stays cheap at 256 seqs.
    """
    n = len(sorted_lens)
    step = max(1, n // _MAX_BUCKET_CUTS)
    cuts = list(range(0, n, step)) + [n]  # bucket = sorted_lens[cuts[i]:cuts[j]]
    best = [0.0] + [float("inf")] * (len(cuts) - 1)
    prev = [0] * len(cuts)
    for j in range(1, len(cuts)):
        for i in range(j):
            cost = best[i] + _BUCKET_OVERHEAD_POSITIONS + (cuts[j] - cuts[i]) * sorted_lens[cuts[j] - 1]
            if cost < best[j]:
                best[j], prev[j] = cost, i
    bounds, j = [], len(cuts) - 1
    while j > 0:
        bounds.append((cuts[prev[j]], cuts[j]))
        j = prev[j]
    return bounds[::-1]


def build_decode_plan(seq_lens: list[int], block_tables: Tensor, seq_ids: list[int] | None,
                      query_rows: list[int] | None, block_size: int, num_kv_heads: int,
                      num_heads: int, q_len: int = 1) -> DecodePlan:
    """Plan the batched path of some sequences with q_len new tokens each: seq_lens[j] is the context
    length of planned sequence j (new tokens included), seq_ids[j] its row of block_tables
    ([num_seqs, max_blocks]) and query_rows[j] the row of q of its first new token (None = j for both:
    every sequence is planned, as in a pure-decode batch; only with q_len 1).
    """
    device = block_tables.device
    order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__)
    sorted_lens = [seq_lens[i] for i in order]
    buckets = []
    heads = torch.arange(num_kv_heads, device=device)
    group = num_heads // num_kv_heads
    bounds = _bucket_bounds(sorted_lens)
    granule = block_size * -(-_WIDTH_GRANULE // block_size)
    for start, end in bounds:
        # One bucket keeps the batch order, so its output needs no scatter back.
        members = order[start:end] if len(bounds) > 1 else list(range(len(seq_lens)))
        member_lens = [seq_lens[i] for i in members]
        table_rows = members if seq_ids is None else [seq_ids[i] for i in members]
        width = granule * -(-sorted_lens[end - 1] // granule)
        positions = torch.arange(width, device=device)
        table_idx = torch.tensor(table_rows, device=device)
        tables = block_tables.index_select(0, table_idx).long()
        # Slot of every (sequence, position < width); padding positions read some valid slot (a column past the
        # table reads its last one, padded columns block 0) and are masked below.
        columns = (positions // block_size).clamp_max_(tables.shape[1] - 1).expand(len(members), -1)
        slots = tables.gather(1, columns) * block_size + positions % block_size
        head_rows = slots[:, None, None, None, :] * num_kv_heads + heads[None, :, None, None, None]  # [B_b,KVH,1,1,S_b]
        cache_rows = head_rows.reshape(-1)
        bag_rows = head_rows.expand(-1, -1, group, q_len, -1).reshape(-1, width)
        lens = torch.tensor(member_lens, device=device)
        key_bias = _key_bias(positions, lens, q_len, num_kv_heads, group)
        in_order = query_rows is None and members == list(range(len(seq_lens)))
        firsts = members if query_rows is None else [query_rows[i] for i in members]
        rows = None if in_order else (torch.tensor(firsts, device=device)[:, None]
                                      + torch.arange(q_len, device=device)).reshape(-1)
        buckets.append(_Bucket(rows, cache_rows, bag_rows, key_bias, len(members), width, q_len))
    return DecodePlan((block_size, num_kv_heads, num_heads), buckets)


def _key_bias(positions: Tensor, lens: Tensor, q_len: int, kv_heads: int, group: int) -> Tensor | None:
    """The bucket's additive mask (see _Bucket.key_bias): new token l of a sequence of context length n
    sees positions < n - q_len + 1 + l. With one new token the mask is padding alone (None when there is
    none), and one row of it broadcasts over the query heads of a kv head."""
    width = positions.numel()
    if q_len == 1 and int(lens.min()) == width:
        return None
    visible_until = lens[:, None] - q_len + 1 + torch.arange(q_len, device=positions.device)  # [B_b, L]
    hidden = positions[None, None, :] >= visible_until[:, :, None]  # [B_b, L, S_b]
    bias = torch.zeros(hidden.shape, dtype=torch.float32, device=positions.device).masked_fill_(hidden, float("-inf"))
    rows = 1 if q_len == 1 else group
    return bias[:, None, None].expand(-1, kv_heads, rows, -1, -1).reshape(-1, rows * q_len, width)


def _decode_bucket(q: Tensor, k_rows: Tensor, v_rows: Tensor, kv_heads: int, bucket: _Bucket,
                   scale: float) -> Tensor:
    """q: [B_b * L, H, D]; k_rows/v_rows: cache viewed as [slots * KVH, D]. Returns [B_b * L, H, D] in q's dtype."""
    _, num_heads, head_dim = q.shape
    num_seqs, q_len, group = bucket.num_seqs, bucket.q_len, num_heads // kv_heads
    keys = k_rows.index_select(0, bucket.cache_rows).view(num_seqs * kv_heads, bucket.width, head_dim)
    # Query heads h*group .. (h+1)*group-1 share kv head h (HF's repeat_kv order); a block's L new tokens
    # ride along the group axis, as (head in group, token) rows. Decode (L = 1) keeps the plain reshape: the
    # general view + permute + reshape is the same tensor but ~3 us more per layer on the hottest path.
    q_grouped = q.reshape(num_seqs * kv_heads, group, head_dim) if q_len == 1 else (
        q.view(num_seqs, q_len, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
        .reshape(num_seqs * kv_heads, group * q_len, head_dim))
    if keys.dtype != torch.float32 and keys.shape[0] * keys.shape[1] <= _SMALL_BUCKET_ROWS:
        # oneDNN's bf16/fp16 bmm costs ~40 us per call whatever its size; a small bucket is faster in fp32.
        q_grouped, keys = q_grouped.float(), keys.float()
    if keys.dtype == torch.float32:
        if bucket.key_bias is None:
            scores = torch.bmm(q_grouped, keys.transpose(1, 2)).mul_(scale)
        else:
            scores = torch.baddbmm(bucket.key_bias, q_grouped, keys.transpose(1, 2), alpha=scale)
    else:
        # Scores leave the bmm in the cache dtype; scaling, padding and softmax run in fp32 (as SDPA's do).
        scores = torch.bmm(q_grouped, keys.transpose(1, 2))
        scores = scores.float().mul_(scale) if bucket.key_bias is None else torch.add(bucket.key_bias, scores,
                                                                                        alpha=scale)
    probs = scores.softmax(dim=-1).to(v_rows.dtype)  # [B_b * KVH, group * L, S_b]; masked keys get exactly 0
    # probs @ V without materializing the gathered V: one weighted bag of cache rows per (sequence, query head, token).
    out = F.embedding_bag(bucket.bag_rows, v_rows, per_sample_weights=probs.view(-1, bucket.width), mode="sum")
    if q_len == 1:
        return out.to(q.dtype).view(num_seqs, num_heads, head_dim)
    out = out.view(num_seqs, kv_heads, group, q_len, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(num_seqs * q_len, num_heads, head_dim).to(q.dtype)


def _run_decode_plan(q: Tensor, out: Tensor | None, k_cache: Tensor, v_cache: Tensor, plan: DecodePlan,
                     scale: float) -> Tensor:
    """Serve the plan's rows of q ([T, H, D]); writes them into out (allocated if None) and returns it."""
    kv_heads, head_dim = k_cache.shape[-2:]
    k_rows, v_rows = k_cache.view(-1, head_dim), v_cache.view(-1, head_dim)
    buckets = plan.buckets
    if len(buckets) == 1 and buckets[0].query_rows is None:
        return _decode_bucket(q, k_rows, v_rows, kv_heads, buckets[0], scale)
    out = torch.empty_like(q) if out is None else out
    for bucket in buckets:
        rows = bucket.query_rows
        out[rows] = _decode_bucket(q.index_select(0, rows), k_rows, v_rows, kv_heads, bucket, scale)
    return out


def _cached_plan(meta: AttentionMetadata, k_cache: Tensor, num_heads: int) -> DecodePlan:
    """The metadata's decode plan for this cache layout, built on the first layer (no buckets: no decode rows)."""
    key = (k_cache.shape[1], k_cache.shape[2], num_heads)
    plan = meta.backend_plan
    if isinstance(plan, DecodePlan) and plan.key == key:
        return plan
    seq_lens = meta.seq_lens.tolist()
    if meta.is_pure_decode:
        plan = build_decode_plan(seq_lens, meta.block_tables, None, None, *key)
    else:
        cu = meta.cu_seqlens_q.tolist()
        plan = DecodePlan(key, []) if meta.tree_mask is not None else _mixed_plan(seq_lens, cu, meta.block_tables, key)
        plan.seq_lens, plan.cu_seqlens_q = seq_lens, cu
    meta.backend_plan = plan
    return plan


def _mixed_plan(seq_lens: list[int], cu: list[int], block_tables: Tensor, key: tuple) -> DecodePlan:
    """A batch with some multi-token sequences and no tree mask: single new tokens, and short causal blocks
    after a prefix grouped by their length L, go through the batched path; the rest through SDPA. A block
    length that only one sequence has stays with SDPA (at batch 1 the batched path gains nothing)."""
    by_len: dict[int, list[int]] = {}
    for i, ctx_len in enumerate(seq_lens):
        n = cu[i + 1] - cu[i]
        if n == 1 or (1 < n <= MAX_BATCHED_QUERY_ROWS and ctx_len > n):
            by_len.setdefault(n, []).append(i)
    by_len = {n: ids for n, ids in by_len.items() if n == 1 or len(ids) > 1}
    buckets: list[_Bucket] = []
    for q_len, seq_ids in sorted(by_len.items()):
        buckets += build_decode_plan([seq_lens[i] for i in seq_ids], block_tables, seq_ids, [cu[i] for i in seq_ids],
                                     *key, q_len=q_len).buckets
    return DecodePlan(key, buckets, batched_seqs=frozenset(i for ids in by_len.values() for i in ids))


def _extend_mask(q_len: int, ctx_len: int, tree_rows: Tensor | None, dtype: torch.dtype,
                 device: torch.device) -> Tensor | None:
    """The additive mask (0 where query_mask allows, -inf elsewhere) of one multi-token sequence; None when it
    is plain causal with no prefix (SDPA's is_causal then skips the masked half)."""
    if tree_rows is None and q_len == ctx_len:
        return None
    allowed = query_mask(q_len, ctx_len, tree_rows, device)
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(allowed.logical_not_(), float("-inf"))


def _one_sequence(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, ctx_len: int,
                  mask: Tensor | None, scale: float) -> Tensor:
    """q: [L, H, D] new tokens at the end of a ctx_len context; mask from _extend_mask. Returns [L, H, D]."""
    num_heads = q.shape[1]
    keys = gather_context(k_cache, block_table, ctx_len)
    values = gather_context(v_cache, block_table, ctx_len)
    causal = mask is None
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),  # [1, H, L, D]
        keys.transpose(0, 1).unsqueeze(0),  # [1, kvh, S, D]
        values.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=keys.shape[1] != num_heads,
    )
    return out.squeeze(0).transpose(0, 1)


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float) -> Tensor:
    """q: [T, H, D]; k_cache/v_cache: [num_blocks, block_size, kvh, D] (new K/V already written).

    Returns [T, H, D] in q's dtype. On a single-threaded fp32 CPU step the C kernel (native_paged) serves every
    sequence with up to MAX_BATCHED_QUERY_ROWS new tokens; longer ones (prefill chunks) go through SDPA.
    """
    if q.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(f"num_heads={q.shape[1]} is not a multiple of num_kv_heads={k_cache.shape[2]}")
    if native_paged.usable(q, k_cache, v_cache):
        out, skipped = native_paged.attend(q, k_cache, v_cache, meta, scale, MAX_BATCHED_QUERY_ROWS)
        if not skipped:
            return out
        plan = _native_plan(meta, k_cache, q.shape[1])
    else:
        plan = _cached_plan(meta, k_cache, q.shape[1])
        if meta.is_pure_decode:
            return _run_decode_plan(q, None, k_cache, v_cache, plan, scale)
        out = torch.empty_like(q)
        if plan.buckets:
            _run_decode_plan(q, out, k_cache, v_cache, plan, scale)
    cu = plan.cu_seqlens_q
    for i, ctx_len in enumerate(plan.seq_lens):
        start, end = cu[i], cu[i + 1]
        if end == start or i in plan.batched_seqs:  # empty, or served by the plan or the kernel
            continue
        if i not in plan.extend_masks:
            tree_rows = meta.tree_mask[start:end] if meta.tree_mask is not None else None
            plan.extend_masks[i] = _extend_mask(end - start, ctx_len, tree_rows, q.dtype, q.device)
        out[start:end] = _one_sequence(q[start:end], k_cache, v_cache, meta.block_tables[i], ctx_len,
                                       plan.extend_masks[i], scale)
    return out


def _native_plan(meta: AttentionMetadata, k_cache: Tensor, num_heads: int) -> DecodePlan:
    """The SDPA side of a kernel-served forward: the sequences the kernel left (more than MAX_BATCHED_QUERY_ROWS
    new tokens), with their lengths as lists, built on the first layer."""
    key = (k_cache.shape[1], k_cache.shape[2], num_heads, "native")
    plan = meta.backend_plan
    if isinstance(plan, DecodePlan) and plan.key == key:
        return plan
    seq_lens, cu = meta.seq_lens.tolist(), meta.cu_seqlens_q.tolist()
    short = frozenset(i for i in range(len(seq_lens)) if cu[i + 1] - cu[i] <= MAX_BATCHED_QUERY_ROWS)
    plan = DecodePlan(key, [], batched_seqs=short, seq_lens=seq_lens, cu_seqlens_q=cu)
    meta.backend_plan = plan
    return plan
