"""The engine's intra-op thread count: a fixed number, or `auto`, a rule by model size, device and step size.

Why a rule: torch defaults to one thread per core, but a decode step of a small model at a small batch is
hundreds of small matmuls; handing each to a second thread costs more than the work it saves. Measured on
the embedded target (8 layers, hidden 256, bf16, 2 cores), 2 threads ran about 2x slower than 1 at batch 1
and at batch 16. A step of many tokens (a prefill chunk, a large batch) has enough rows per matmul for every
core to pay: with torch's matmuls from ``WIDE_STEP_TOKENS`` (32) tokens. Where the one-thread native C layers
serve the model (fp32 on CPU), they win up to their ``SMALL_GEMM_MAX_ROWS`` rows instead, their calls split over
every core (below): on the 20-layer embedded target (2 cores) a verify forward of 80 rows (batch 16, K=4) took
27.7 ms against 54.1 with torch's ops on 2 threads, 128 decode rows 62.7 against 99.4
(kernels/layers/linear.py has the figures). So a small model runs smaller steps on one thread and larger ones
on every core (switching costs nothing measurable: torch keeps its thread pool).
Larger models use every core for every step.

The native C kernels of a one-thread step split each call over every core instead (``native_count``,
kernels/csrc/parallel.c: a GEMM's output panels, attention's (sequence, kv head) units, on helper threads that spin
between a step's calls, so a hand-off costs about a microsecond, where torch's costs tens). Bit for bit the
one-thread result. On the 20-layer embedded target (2-core AVX2 EPYC, fp32) greedy batch-1 decoding ran 1.47x faster with the GEMMs split than on one thread (interleaved in
one run); with attention split too, a plain step's forward took 2.6 ms and a 5-row verify forward 3.3
(scripts/bench_spec_round.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

import draftsmith
from draftsmith.kernels import native

log = logging.getLogger(__name__)

AUTO = "auto"
# Below this many parameters a CPU decode step is dominated by per-op overhead, not arithmetic.
SMALL_MODEL_PARAMS = 100_000_000
# From this many tokens in one step (every sequence's new tokens and draft slots), a small model's torch matmuls
# have enough rows for every core (2 threads lost at 16 rows and won from 32). A model the native C layers serve
# (fp32 on CPU) stays on one thread up to their SMALL_GEMM_MAX_ROWS rows, where they beat MKL on 2 threads
# (kernels/layers/linear.py has the figures): choose_threads' native_rows.
WIDE_STEP_TOKENS = 32


@dataclass(frozen=True)
class ThreadChoice:
    count: int  # intra-op threads of a step below wide_from_tokens tokens (every step when wide_count is None)
    setting: int | str  # what was asked for: a count or "auto"
    reason: str  # why this count (logged, reported by the eval and the benchmarks)
    wide_count: int | None = None  # threads of a step of at least wide_from_tokens tokens
    wide_from_tokens: int = WIDE_STEP_TOKENS
    native_count: int = 1  # threads the native C kernels of a one-thread step split a call over

    def for_step(self, num_tokens: int) -> int:
        """The count a step of num_tokens new tokens (draft slots included) runs with."""
        if self.wide_count is not None and num_tokens >= self.wide_from_tokens:
            return self.wide_count
        return self.count

    def describe(self) -> str:
        """e.g. "1" or "1 (2 from 257 tokens per step)": the counts the reports print."""
        native = f"; native kernels on {self.native_count}" if self.native_count > 1 else ""
        if self.wide_count is None or self.wide_count == self.count:
            return f"{self.count} ({native[2:]})" if native else str(self.count)
        return f"{self.count} ({self.wide_count} from {self.wide_from_tokens} tokens per step{native})"

    def summary(self) -> str:
        """The counts with what was asked for and why: the log line's and the eval report's words."""
        return f"{self.describe()} (num_threads={self.setting}: {self.reason})"


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


def choose_threads(setting: int | str, num_params: int, device: str, cores: int | None = None,
                   native_rows: int = 0) -> ThreadChoice:
    """The count for `setting`: a positive int is taken as is; "auto" applies the module's rule. native_rows: the
    rows up to which the model's forward runs the one-thread native C layers (0: it does not)."""
    if setting != AUTO:
        if isinstance(setting, bool) or not isinstance(setting, int) or setting <= 0:
            raise ValueError(f"num_threads must be a positive int or {AUTO!r}, got {setting!r}")
        return ThreadChoice(setting, setting, "configured", native_count=setting)
    cores = available_cores() if cores is None else cores
    if torch.device(device).type != "cpu":
        return ThreadChoice(min(cores, torch.get_num_threads()), AUTO,
                            f"{device}: the CPU only schedules, torch's default kept")
    if num_params < SMALL_MODEL_PARAMS:
        wide_from = max(WIDE_STEP_TOKENS, native_rows + 1)
        wide = f", a step of {wide_from}+ tokens has rows enough for every core" if cores > 1 else ""
        native = (f" (the native C layers serve up to {native_rows} rows, their calls split over {cores} cores)"
                  if native_rows and cores > 1 else
                  f" (the native C layers serve up to {native_rows} rows)" if native_rows else "")
        return ThreadChoice(1, AUTO, f"small model on CPU ({num_params / 1e6:.1f}M params < "
                                     f"{SMALL_MODEL_PARAMS / 1e6:.0f}M): a small step's per-op work is below a "
                                     f"thread hand-off{wide}{native}", wide_count=cores if cores > 1 else None,
                            wide_from_tokens=wide_from, native_count=cores if native_rows else 1)
    return ThreadChoice(cores, AUTO, f"{num_params / 1e6:.0f}M params on CPU: one thread per core ({cores})")


_warned_spinning_omp = False   # the warning below, once per process


def apply_threads(choice: ThreadChoice) -> None:
    """Set torch's intra-op count (process-wide) to a small step's, and the native kernels' split, and log the
    choice (with a warning where torch's OpenMP workers spin between ops: draftsmith/__init__ says why it matters)."""
    set_threads(choice.count)
    native.set_threads(choice.native_count)
    log.info("engine: intra-op threads %s", choice.summary())
    global _warned_spinning_omp
    if not draftsmith.OMP_PASSIVE and max(choice.count, choice.wide_count or 1) > 1 and not _warned_spinning_omp:
        _warned_spinning_omp = True
        log.warning("engine: OpenMP workers spin after each multi-thread op (OMP_WAIT_POLICY is not PASSIVE where "
                    "torch was imported), which slows the one-thread steps that follow; set OMP_WAIT_POLICY=PASSIVE "
                    "before starting Python, or import draftsmith before torch")


@contextmanager
def threads_for(choice: ThreadChoice | None, num_tokens: int) -> Iterator[None]:
    """Within: the count a forward of num_tokens rows runs with (choice.for_step), the previous count restored after.
    A draft's catch-up forward runs inside a target step of few tokens: after plain steps a standalone draft catches
    up on every sequence's tokens since (16 x 64 rows at batch 16), 30 ms on the step's one thread against 16-19 on
    two (the AVX2-only VM). None (no engine attached): torch's count as it is."""
    if choice is None:
        yield
        return
    before = torch.get_num_threads()
    set_threads(choice.for_step(num_tokens))
    try:
        yield
    finally:
        set_threads(before)


def set_threads(count: int) -> None:
    """torch's intra-op count, set only when it changes (the engine calls this every step)."""
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)
