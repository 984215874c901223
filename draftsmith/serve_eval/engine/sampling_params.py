"""SamplingParams: per-request decoding settings, validated at construction.

Every check raises ValueError naming the offending field, so a bad request fails
at construction and never reaches the batch: a SamplingParams that exists can be sampled.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from draftsmith.kernels.sampling import check_sampling_values


def _is_int(value: object) -> bool:
    # bool is an int subclass; a True top_k is almost surely a bug, reject it.
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    temperature: float = 1.0      # 0 = greedy
    top_k: int = 0                # 0 = off
    top_p: float = 1.0            # 1 = off
    seed: int | None = None       # per-request torch.Generator seed
    max_tokens: int = 64
    # vLLM's min_tokens: the first min_tokens output tokens cannot be EOS or a stop token, and stop strings are
    # not checked before them (serve_eval.engine.min_tokens masks the target's rows).
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise ValueError(f"temperature must be a number, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)):
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        # The ranges, checked in the dtypes the sampling kernels use them in (float32, int64).
        check_sampling_values(self.temperature, self.top_k, self.top_p, self.seed)
        if not _is_int(self.max_tokens) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be an int > 0, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an int in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        # Accept a single string for convenience; store a list so callers see one shape.
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a str or a list of str, got {self.stop!r}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop must not contain an empty string")
        self.stop = list(self.stop)
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(f"stop_token_ids must be a list of ints >= 0, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"logprobs must be None or an int >= 0, got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
