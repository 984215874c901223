"""flash-attn adapter: paged varlen attention through ``flash_attn_varlen_func(..., block_table=...)``.

flash_attn is imported lazily (only on CUDA, only when installed), so this module imports anywhere.
flash-attn 2 pages the KV cache only in blocks that are a multiple of 256 tokens; other block sizes and
tree masks (which flash-attn cannot express) go to the Triton kernel, which serves the same contract.
Causal masking in flash-attn >= 2.1 is aligned to the bottom-right corner when seqlen_q < seqlen_k, which
is exactly "new tokens at the end of the context".
"""

from __future__ import annotations

import importlib
import importlib.util
from functools import lru_cache
from types import ModuleType

import torch
from torch import Tensor

from draftsmith.kernels.attention import AttentionMetadata

FLASH_PAGE_MULTIPLE = 256


@lru_cache(maxsize=1)
def _flash_module() -> ModuleType | None:
    if not torch.cuda.is_available() or importlib.util.find_spec("flash_attn") is None:
        return None
    try:
        return importlib.import_module("flash_attn")
    except (ImportError, OSError):  # a wheel built for another torch/CUDA fails at load, not at find_spec
        return None


def is_available() -> bool:
    """True when flash_attn imports and a CUDA device is present."""
    return _flash_module() is not None


def supports_block_size(block_size: int) -> bool:
    return block_size % FLASH_PAGE_MULTIPLE == 0


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, scale: float) -> Tensor:
    """Same contract as ``draftsmith.kernels.attention.attention``. q: [T, H, D] on CUDA -> [T, H, D]."""
    flash_attn = _flash_module()
    if flash_attn is None:
        raise ValueError("flash attention backend needs CUDA and the flash_attn package; neither is usable here")
    if meta.tree_mask is not None or not supports_block_size(k_cache.shape[1]):
        from draftsmith.kernels.attention.triton_paged import paged_attention as triton_attention

        return triton_attention(q, k_cache, v_cache, meta, scale)
    cu_seqlens_k = torch.zeros_like(meta.cu_seqlens_q)
    torch.cumsum(meta.seq_lens, 0, out=cu_seqlens_k[1:])
    return flash_attn.flash_attn_varlen_func(
        q, k_cache, v_cache,
        cu_seqlens_q=meta.cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=meta.max_seqlen_q,
        max_seqlen_k=meta.max_seqlen_k,
        softmax_scale=scale,
        causal=True,
        block_table=meta.block_tables,
    )
