"""The block-parallel (DFlash-style) draft in `draftsmith plan`: its draft cost is ONE forward per round.

An autoregressive draft reads its weights K times per round (K sequential steps). The block draft evaluates its
query block [root, mask x K] in one forward, so under the bandwidth model a round reads its layers and the shared
LM head once, whatever K is (the K + 1 query rows ride on the same weight read).
"""
from __future__ import annotations

from typing import Any, Callable

# No seed figure exists for the block draft: assume EAGLE's (pass --alpha-block with a measured one).
BLOCK_ALPHA = 0.72
FC_INPUTS = 3  # aux layers fused by fc (EAGLE-3's choice): fc is [3 d -> d]


def block_params(target: Any, num_layers: int) -> float:
    """num_layers target-shaped decoder layers plus the aux-fusion fc (masks and norms are negligible)."""
    return num_layers * target.layer_params() + FC_INPUTS * target.hidden_size * target.hidden_size


def block_row(strategy: Callable, target: Any, hw: Any, drafts: Any, target_ms: float, free_gb: float,
              draft_bytes: float, lm_head_bytes: float, gb: float) -> Any:
    """The plan's StrategyRow for the block draft (``strategy`` is plan._strategy)."""
    params = block_params(target, drafts.block_layers)
    draft_gb = params * draft_bytes / gb / hw.tp
    round_ms = drafts.block_round_ms if drafts.block_round_ms is not None else \
        hw.read_ms(draft_gb * gb + lm_head_bytes / hw.tp)
    return strategy("block", drafts.K, drafts.alpha["block"], target_ms, round_ms, draft_gb, free_gb,
                    f"{params / 1e9:.2f}B params ({drafts.block_layers} layers); ONE forward per round, not K")


def add_block_args(group: Any) -> None:
    group.add_argument("--alpha-block", type=float, default=BLOCK_ALPHA,
                       help="assumed acceptance rate of the block draft (no seed figure: EAGLE's)")
    group.add_argument("--block-layers", type=int, default=2, help="decoder layers of the block draft")
    group.add_argument("--block-round-ms", type=float, help="measured block-draft cost per round (one forward)")
