"""Sequence: one generation stream and everything the scheduler and KV cache know about it."""
from __future__ import annotations

import enum
import itertools
import time
from typing import TYPE_CHECKING

import torch

from draftsmith.serve_eval.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from draftsmith.serve_eval.engine.parallel_sampling import SampleGroup
    from draftsmith.serve_eval.speculative.metrics import SpecStats


class SequenceStatus(enum.Enum):
    WAITING = "waiting"      # not holding KV blocks (new, or preempted by recompute)
    RUNNING = "running"      # holds GPU blocks, scheduled each step
    SWAPPED = "swapped"      # its KV lives in the CPU block pool
    FINISHED = "finished"


_seq_counter = itertools.count()


class Sequence:
    """Token ids + progress counters of one generation stream: a whole n == 1 request, or one sample of
    an n > 1 request (then `request_id` is the stream's own id, `<request id>#<i>`, and `group` the
    request's SampleGroup; serve_eval.engine.parallel_sampling).

    Invariant: the KV cache holds positions [0, num_computed_tokens); token_ids beyond
    that still need a forward pass. The last sampled token is in token_ids but not yet
    in the cache, so a decode step schedules exactly one token (plus lookahead slots
    when a speculative proposer asks for them).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        domain: str | None = None,
        arrival_time: float | None = None,
    ) -> None:
        self.seq_id: int = next(_seq_counter)
        self.request_id = request_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.priority = priority
        self.domain = domain
        self.arrival_time = time.perf_counter() if arrival_time is None else arrival_time
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        # Speculative decoding reserves this many extra KV slots per decode step.
        self.num_lookahead_tokens = 0
        # Chained hashes of the full blocks of token_ids (a pure function of the tokens,
        # so it survives preemption); extended lazily by the KV cache manager.
        self.block_hashes: list[int] = []
        self.num_cached_prefix_tokens = 0   # prefix-cache hit size at the last admission
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)
        self.finish_reason: str | None = None
        self.stop_text_len: int | None = None   # text truncated here when a stop string hit
        self.first_token_time: float | None = None
        self.token_times: list[float] = []
        self.spec_stats: SpecStats | None = None   # this request's speculative rounds (set by the strategy)
        self.finished_time: float | None = None
        self.logprobs: list = []   # one engine.logprobs.TokenLogprob per output token (params.logprobs set)
        self.group: SampleGroup | None = None   # the n > 1 request this sequence samples for
        self.sample_index = 0                   # its index among the group's n samples

    # -- views ---------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_prefill(self) -> bool:
        """True while more than the last sampled token is missing from the cache."""
        return self.num_tokens - self.num_computed_tokens > 1

    @property
    def num_pending_samples(self) -> int:
        """Running sequences this one stands for: n while an n > 1 request has not forked yet, else 1."""
        return 1 if self.group is None or self.group.forked else self.group.n

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int, now: float) -> None:
        self.token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = now
        self.token_times.append(now)

    def replace_last_token(self, token_id: int) -> None:
        """Swap the last (not yet computed) token: a forked sample's own first token."""
        assert self.num_computed_tokens < self.num_tokens, "the last token is already in the KV cache"
        self.token_ids[-1] = token_id
        # The hashes are a pure function of the tokens: recomputed lazily, equal for unchanged blocks.
        self.block_hashes = []

    def fork(self, request_id: str, params: SamplingParams | None = None,
             generator: torch.Generator | None = None) -> "Sequence":
        """A child with the same tokens and progress; the KV manager shares its blocks. It samples with
        `params` (default: the parent's) and `generator` (default: a fresh one from params.seed)."""
        child = Sequence(request_id, self.prompt_token_ids, params or self.params, self.priority,
                         self.domain, self.arrival_time)
        child.token_ids = list(self.token_ids)
        child.num_computed_tokens = self.num_computed_tokens
        child.block_hashes = list(self.block_hashes)
        child.num_cached_prefix_tokens = self.num_cached_prefix_tokens
        child.first_token_time = self.first_token_time
        child.token_times = list(self.token_times)
        child.logprobs = list(self.logprobs)
        child.status = self.status
        if generator is not None:
            child.generator = generator
        return child

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request_id!r}, status={self.status.value}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens})")
