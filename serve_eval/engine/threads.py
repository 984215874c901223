"""The engine's intra-op thread count: a fixed number, or `auto`, a rule by model size and device.

Why a rule: torch defaults to one thread per core, but a decode step of a small model is hundreds of
small matmuls; handing each to a second thread costs more than the work it saves. Measured on the
embedded target (8 layers, hidden 256, bf16, 2 cores), 2 threads ran about 2x slower than 1 at batch
1 and at batch 16. Larger models have enough work per op for every core to pay.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

AUTO = "auto"
# Below this many parameters a CPU decode step is dominated by per-op overhead, not arithmetic.
SMALL_MODEL_PARAMS = 100_000_000


@dataclass(frozen=True)
class ThreadChoice:
    count: int  # intra-op threads the engine runs with
    setting: int | str  # what was asked for: a count or "auto"
    reason: str  # why this count (logged, reported by the eval and the benchmarks)


def available_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def estimate_num_params(model_config: Any) -> int:
    """Parameters of a Llama-family decoder from its config (attention, MLP, embedding; norms ignored)."""
    hidden = int(model_config.hidden_size)
    layers = int(model_config.num_hidden_layers)
    heads = int(model_config.num_attention_heads)
    kv_heads = int(getattr(model_config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(model_config, "head_dim", None) or hidden // heads)
    inter = int(model_config.intermediate_size)
    vocab = int(model_config.vocab_size)
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q, o, k, v
    embeddings = vocab * hidden * (1 if getattr(model_config, "tie_word_embeddings", False) else 2)
    return layers * (attention + 3 * hidden * inter) + embeddings


def choose_threads(setting: int | str, num_params: int, device: str, cores: int | None = None) -> ThreadChoice:
    """The count for `setting`: a positive int is taken as is; "auto" applies the module's rule."""
    if setting != AUTO:
        if isinstance(setting, bool) or not isinstance(setting, int) or setting <= 0:
            raise ValueError(f"num_threads must be a positive int or {AUTO!r}, got {setting!r}")
        return ThreadChoice(setting, setting, "configured")
    cores = available_cores() if cores is None else cores
    if torch.device(device).type != "cpu":
        return ThreadChoice(min(cores, torch.get_num_threads()), AUTO,
                            f"{device}: the CPU only schedules, torch's default kept")
    if num_params < SMALL_MODEL_PARAMS:
        return ThreadChoice(1, AUTO, f"small model on CPU ({num_params / 1e6:.1f}M params < "
                                     f"{SMALL_MODEL_PARAMS / 1e6:.0f}M): per-op work is below a thread hand-off")
    return ThreadChoice(cores, AUTO, f"{num_params / 1e6:.0f}M params on CPU: one thread per core ({cores})")


def apply_threads(choice: ThreadChoice) -> None:
    """Set torch's intra-op count (process-wide) and log the choice."""
    if torch.get_num_threads() != choice.count:
        torch.set_num_threads(choice.count)
    log.info("engine: %d intra-op thread(s) (num_threads=%s: %s)", choice.count, choice.setting, choice.reason)
