"""Parallel sampling (SamplingParams.n > 1): one request, its prompt prefilled once, n samples.

Sample 0 (the parent) runs the prompt like any request. The logits row of its last prompt token is
drawn from n times, once per sample with that sample's own generator (seed + i: what n separate
seeded n == 1 requests would use, so sample i is token-identical to such a request). The parent then
forks into n - 1 children that share every KV block of the prompt (ref-counted in the block pool);
the first write into a shared partial last block copies it (kv_cache_manager.allocate_slots). From
there each sample decodes, is preempted and finishes on its own; the request finishes with the last.

Each sample is its own Sequence keyed by its own stream id, `<request id>#<i>`, so state kept per
sequence id (speculative proposers, their metrics) stays per sample.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from draftsmith.kernels.sampling import check_sampling_values, sample_logits
from draftsmith.serve_eval.engine.logprobs import TokenLogprob, token_logprobs
from draftsmith.serve_eval.engine.request import Sequence
from draftsmith.serve_eval.engine.sampling_params import SamplingParams
from draftsmith.serve_eval.engine.scheduler import Scheduler


@dataclass
class FirstDraw:
    """The first tokens of samples 1 .. n-1, drawn from the parent's last prompt row."""
    tokens: list[int]
    generators: list[torch.Generator | None]   # each sample's own, past this draw (None: the engine's)
    logprobs: list[TokenLogprob] | None        # one record per token when the request asked for logprobs


class SampleGroup:
    """The n sequences of one n > 1 request: only the parent until its first token, then all n."""

    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.params = params                 # as submitted: n, and the seed of sample 0
        self.n = params.n
        self.samples: list[Sequence] = []    # by sample index
        self.first_draw: FirstDraw | None = None

    @property
    def forked(self) -> bool:
        return len(self.samples) == self.n

    @property
    def finished(self) -> bool:
        return self.forked and all(s.is_finished for s in self.samples)

    def stream_id(self, index: int) -> str:
        return stream_id(self.request_id, index)

    def sample_params(self, index: int) -> SamplingParams:
        """Sample `index` decodes as an n == 1 request seeded seed + index would."""
        seed = None if self.params.seed is None else self.params.seed + index
        return replace(self.params, n=1, seed=seed)

    def new_parent(self, prompt_ids: list[int], priority: int, domain: str | None) -> Sequence:
        seq = Sequence(self.stream_id(0), prompt_ids, self.sample_params(0), priority, domain)
        seq.group = self
        self.samples = [seq]
        return seq

    def awaits_first_draw(self, seq: Sequence) -> bool:
        return not self.forked and seq.num_output_tokens == 0 and seq is self.samples[0]


def stream_id(request_id: str, index: int) -> str:
    return f"{request_id}#{index}"


def check_n(params: SamplingParams, max_samples: int, max_num_seqs: int) -> None:
    """ValueError naming n when the engine cannot serve that many samples of one request."""
    if params.n > max_samples:
        raise ValueError(f"n={params.n}: at most {max_samples} samples per request "
                         "(EngineConfig.max_samples_per_request)")
    if params.n > max_num_seqs:
        raise ValueError(f"n={params.n} exceeds max_num_seqs={max_num_seqs}: its samples run as "
                         "that many sequences")
    if params.seed is not None and params.n > 1:
        last = params.seed + params.n - 1
        try:
            check_sampling_values(params.temperature, params.top_k, params.top_p, last)
        except ValueError as exc:
            raise ValueError(f"seed + n - 1 = {last} (sample i samples with seed + i): {exc}") from None


def draw_first_tokens(group: SampleGroup, logits_row: torch.Tensor, engine_generator: torch.Generator) -> FirstDraw:
    """Samples 1 .. n-1 draw their first token from the parent's row [V], each with its own generator,
    exactly as engine.sample draws a one-row batch for an n == 1 request (kernels.sampling)."""
    params = [group.sample_params(i) for i in range(1, group.n)]
    generators = [None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params]
    rows = logits_row.unsqueeze(0).expand(len(params), -1)
    if group.params.greedy:
        tokens = rows.argmax(dim=-1).tolist()
    else:
        p = group.params
        tokens = sample_logits(rows, [p.temperature] * len(params), [p.top_k] * len(params), [p.top_p] * len(params),
                               generators if group.params.seed is not None else engine_generator).tolist()
    records = None
    if group.params.logprobs is not None:
        records = token_logprobs(rows, tokens, group.params.logprobs)
    return FirstDraw(tokens, generators, records)


def fork_samples(group: SampleGroup, scheduler: Scheduler) -> list[Sequence]:
    """Right after the parent appended its first token: the n - 1 children, running, sharing its
    blocks, each holding its own first token in place of the parent's."""
    draw = group.first_draw
    if draw is None:
        raise RuntimeError(f"request {group.request_id!r}: its first token was not drawn through "
                           "engine.sample, so its other samples have none")
    parent = group.samples[0]
    children = []
    for i, (token, generator) in enumerate(zip(draw.tokens, draw.generators), start=1):
        child = scheduler.fork(parent, group.stream_id(i), group.sample_params(i), generator)
        child.replace_last_token(token)
        child.group, child.sample_index = group, i
        if draw.logprobs is not None:
            child.logprobs[-1] = draw.logprobs[i - 1]
        children.append(child)
    group.samples.extend(children)
    group.first_draw = None
    return children
