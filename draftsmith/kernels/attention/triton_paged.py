"""Triton paged attention: one kernel for prefill chunks, decode and tree verification, over block tables.

Each program owns a tile of up to BLOCK_M query tokens of ONE sequence and one query head. It walks that
sequence's context BLOCK_N keys at a time, translating key positions to cache slots through the block
table (so any block size works), and keeps an online softmax (running max / running sum) so the context
is read once. GQA: the program reads the KV head its query head belongs to.

Runs on CUDA, or on CPU under ``TRITON_INTERPRET=1`` (set before this module is imported) for tests.
Importing this module does not need a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from draftsmith.kernels.attention import AttentionMetadata


@triton.jit
def _load_cache_rows(cache_ptr, slots, kv_head, stride_slot, stride_head, offs_d, kv_mask):
    """[BLOCK_N, BLOCK_D] of one KV head at these cache slots (masked rows read as 0)."""
    return tl.load(cache_ptr + slots[:, None] * stride_slot + kv_head * stride_head + offs_d[None, :],
                   mask=kv_mask, other=0.0)


@triton.jit
def _visible(offs_m, offs_n, rows, m_valid, n_valid, prefix, tree_mask_ptr, stride_tree, HAS_TREE: tl.constexpr):
    """[BLOCK_M, BLOCK_N]: which keys each query may attend to. The cached prefix is visible to every new
    token; among the new tokens, causal order, or the tree's ancestor mask when verifying a tree."""
    local_n = offs_n - prefix  # index among the new tokens (negative = prefix)
    in_prefix = (offs_n < prefix)[None, :]
    if HAS_TREE:
        own = m_valid[:, None] & (local_n >= 0)[None, :] & n_valid[None, :]
        tree_ok = tl.load(tree_mask_ptr + rows[:, None] * stride_tree + local_n[None, :], mask=own, other=0)
        allowed = in_prefix | (tree_ok != 0)
    else:
        allowed = in_prefix | (local_n[None, :] <= offs_m[:, None])
    return allowed & n_valid[None, :]


@triton.jit
def _online_softmax_step(m_i, l_i, acc, scores, v, DOT_PRECISION: tl.constexpr):
    """Fold one block of scores into the running max, running sum and weighted values."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    cu_seqlens_q_ptr, seq_lens_ptr, block_tables_ptr, tile_seq_ptr, tile_qstart_ptr, tree_mask_ptr,
    scale,
    stride_qt, stride_qh,
    stride_kslot, stride_kh,
    stride_vslot, stride_vh,
    stride_ot, stride_oh,
    stride_bt, stride_tree,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_TREE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    seq = tl.load(tile_seq_ptr + tile)
    q_local_start = tl.load(tile_qstart_ptr + tile)
    row_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - row_start
    ctx_len = tl.load(seq_lens_ptr + seq)
    prefix = ctx_len - q_len  # positions every new token of this sequence may see

    offs_m = q_local_start + tl.arange(0, BLOCK_M)  # local query indices
    offs_d = tl.arange(0, BLOCK_D)
    m_valid = offs_m < q_len
    d_valid = offs_d < HEAD_DIM
    rows = row_start + offs_m
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_valid[:, None] & d_valid[None, :], other=0.0)

    if HAS_TREE:
        kv_end = ctx_len
    else:
        # Causal: the last query of this tile sees nothing past its own position.
        kv_end = prefix + tl.minimum(q_len, q_local_start + BLOCK_M)

    # Finite start value so fully masked rows give exp(-inf - m) = 0 rather than NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(0, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)  # key positions
        n_valid = offs_n < kv_end
        block_ids = tl.load(block_tables_ptr + seq * stride_bt + offs_n // BLOCK_SIZE, mask=n_valid, other=0)
        slots = block_ids.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE
        kv_mask = n_valid[:, None] & d_valid[None, :]
        k = _load_cache_rows(k_cache_ptr, slots, kv_head, stride_kslot, stride_kh, offs_d, kv_mask)
        v = _load_cache_rows(v_cache_ptr, slots, kv_head, stride_vslot, stride_vh, offs_d, kv_mask)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [BLOCK_M, BLOCK_N]
        allowed = _visible(offs_m, offs_n, rows, m_valid, n_valid, prefix, tree_mask_ptr, stride_tree, HAS_TREE)
        scores = tl.where(allowed, scores, float("-inf"))

        m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, scores, v, DOT_PRECISION)

    out = acc / tl.maximum(l_i, 1.0e-30)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & d_valid[None, :])


@dataclass(frozen=True)
class TritonPlan:
    """What every layer's launch of one forward shares: the query tiling and the tree mask as int8.

    Built on the first layer's call and kept in ``meta.backend_plan``. Building it per layer cost a device
    synchronization per layer on a GPU (the tiling's output size depends on the query lengths), which kept
    the CPU from queueing the next layers' kernels ahead of the GPU."""

    block_m: int
    tile_seq: Tensor     # int32 [tiles]: the sequence of each tile
    tile_qstart: Tensor  # int32 [tiles]: the tile's first query row within its sequence
    tree: Tensor | None  # int8 [T, max_seqlen_q], or None (causal)


def launch_plan(meta: AttentionMetadata) -> TritonPlan:
    """This forward's plan (built once per metadata)."""
    if isinstance(meta.backend_plan, TritonPlan):
        return meta.backend_plan
    block_m = 16 if meta.max_seqlen_q <= 16 else 64
    if meta.max_seqlen_q <= block_m:  # one tile per sequence (decode, verify rounds): known without the device
        device = meta.cu_seqlens_q.device
        tile_seq = torch.arange(meta.num_seqs, dtype=torch.int32, device=device)
        tile_qstart = torch.zeros(meta.num_seqs, dtype=torch.int32, device=device)
    else:
        tile_seq, tile_qstart = _query_tiles(meta.cu_seqlens_q, block_m)
    tree = None if meta.tree_mask is None else meta.tree_mask.to(torch.int8).contiguous()
    meta.backend_plan = plan = TritonPlan(block_m, tile_seq, tile_qstart, tree)
    return plan


def _query_tiles(cu_seqlens_q: Tensor, block_m: int) -> tuple[Tensor, Tensor]:
    """Split every sequence's new tokens into tiles of block_m: (tile -> seq, tile -> local q start)."""
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    tiles_per_seq = (q_lens + block_m - 1) // block_m
    seq_ids = torch.arange(q_lens.shape[0], device=q_lens.device)
    tile_seq = torch.repeat_interleave(seq_ids, tiles_per_seq)
    first_tile = torch.cumsum(tiles_per_seq, 0) - tiles_per_seq
    tile_index = torch.arange(tile_seq.shape[0], device=q_lens.device) - first_tile[tile_seq]
    return tile_seq.to(torch.int32), (tile_index * block_m).to(torch.int32)


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float) -> Tensor:
    """Same contract as ``draftsmith.kernels.attention.attention``. q: [T, H, D] -> [T, H, D]."""
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if k_cache.stride(0) != block_size * k_cache.stride(1) or k_cache.stride(-1) != 1:
        raise ValueError("k_cache must be contiguous over [num_blocks, block_size, ...] with unit last stride")
    if v_cache.stride(0) != block_size * v_cache.stride(1) or v_cache.stride(-1) != 1:
        raise ValueError("v_cache must be contiguous over [num_blocks, block_size, ...] with unit last stride")
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    plan = launch_plan(meta)
    block_m, tile_seq, tile_qstart = plan.block_m, plan.tile_seq, plan.tile_qstart
    block_n = 32 if q.device.type == "cpu" else 64
    has_tree = plan.tree is not None
    tree = plan.tree if has_tree else tile_seq  # dummy pointer when unused
    grid = (tile_seq.shape[0], num_heads)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out,
        meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, tile_seq, tile_qstart, tree,
        scale,
        q.stride(0), q.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        meta.block_tables.stride(0), tree.stride(0) if has_tree else 0,
        HEAD_DIM=head_dim, GROUP=num_heads // num_kv_heads, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        HAS_TREE=has_tree,
        # fp32 stays fp32 (tf32 would cost ~1e-3 of accuracy on GPUs); 16-bit inputs ignore this.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out
