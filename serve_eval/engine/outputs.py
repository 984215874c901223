"""What the engine hands back: per-request outputs and timings, and engine-wide stats."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:   # the speculative package fills these; the engine only carries them
    from serve_eval.engine.logprobs import TokenLogprob
    from serve_eval.speculative.metrics import SpecEngineStats, SpecStats


@dataclass
class RequestMetrics:
    arrival_time: float                 # time.perf_counter() at add_request
    first_token_time: float | None      # first sampled token (TTFT = this - arrival_time)
    token_times: list[float]            # one timestamp per output token
    finished_time: float | None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def inter_token_latencies(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]         # all output tokens so far
    new_token_ids: list[int]            # tokens added this step
    finished: bool
    finish_reason: str | None           # "stop" | "length" | "abort" | None
    metrics: RequestMetrics
    spec: "SpecStats | None" = None     # this request's rounds when speculative decoding runs
    # One TokenLogprob (engine.logprobs) per output token so far, when SamplingParams.logprobs is set; else None.
    logprobs: "list[TokenLogprob] | None" = None
    # Decoding every request every step would cost more than the scheduler; text is
    # decoded on first access (or given eagerly when a stop string already needed it).
    _detokenize: Callable[[list[int]], str] | None = field(default=None, repr=False)
    _text: str | None = field(default=None, repr=False)
    _text_limit: int | None = field(default=None, repr=False)

    @property
    def text(self) -> str:
        if self._text is None:
            self._text = self._detokenize(self.output_token_ids) if self._detokenize else ""
            if self._text_limit is not None:
                self._text = self._text[:self._text_limit]
        return self._text


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_blocks_total: int
    kv_blocks_used: int           # ref_cnt > 0
    kv_blocks_cached: int         # free but still holding a prefix-cache entry (evictable)
    kv_blocks_free: int           # free and empty
    prefix_cache_hit_rate: float  # prompt tokens served from cache / prompt tokens admitted
    num_preemptions: int
    num_swap_preemptions: int
    num_steps: int
    spec: "SpecEngineStats | None" = None      # the speculative strategy's counters; None without one
    num_threads: int = 0          # intra-op threads the engine chose (EngineConfig.num_threads)
