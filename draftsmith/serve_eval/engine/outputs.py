"""What the engine hands back: per-request outputs and timings, and engine-wide stats."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:   # the speculative package fills these; the engine only carries them
    from draftsmith.serve_eval.engine.logprobs import TokenLogprob
    from draftsmith.serve_eval.speculative.metrics import SpecEngineStats, SpecStats


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
class CompletionOutput:
    """One of a request's n samples (SamplingParams.n), as it stands after a step."""
    index: int                          # which sample, 0 .. n - 1
    output_token_ids: list[int]         # all its output tokens so far
    new_token_ids: list[int]            # tokens it added this step ([] when it did not advance)
    finished: bool
    finish_reason: str | None           # "stop" | "length" | "abort" | None
    metrics: RequestMetrics
    spec: "SpecStats | None" = None     # this sample's rounds when speculative decoding runs
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
class RequestOutput:
    """A request after a step: its n completions (one for n == 1), each with what it added this step.

    The per-completion fields (output_token_ids, new_token_ids, finish_reason, metrics, spec, logprobs,
    text) read the only completion of an n == 1 request; for n > 1 they raise: read `completions`."""
    request_id: str
    prompt_token_ids: list[int]
    completions: list[CompletionOutput]   # by index
    finished: bool                        # every completion has finished

    @property
    def num_new_tokens(self) -> int:
        """Tokens all completions added this step."""
        return sum(len(c.new_token_ids) for c in self.completions)

    def _only(self, what: str) -> CompletionOutput:
        if len(self.completions) != 1:
            raise ValueError(f"RequestOutput.{what}: request {self.request_id!r} has n={len(self.completions)} "
                             "completions; read .completions")
        return self.completions[0]

    @property
    def output_token_ids(self) -> list[int]:
        return self._only("output_token_ids").output_token_ids

    @property
    def new_token_ids(self) -> list[int]:
        return self._only("new_token_ids").new_token_ids

    @property
    def finish_reason(self) -> str | None:
        return self._only("finish_reason").finish_reason

    @property
    def metrics(self) -> RequestMetrics:
        return self._only("metrics").metrics

    @property
    def spec(self) -> "SpecStats | None":
        return self._only("spec").spec

    @property
    def logprobs(self) -> "list[TokenLogprob] | None":
        return self._only("logprobs").logprobs

    @property
    def text(self) -> str:
        return self._only("text").text


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
