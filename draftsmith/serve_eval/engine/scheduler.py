"""Scheduler: iteration-level continuous batching under a per-step token budget.

Each step: (1) a waiting request of a higher priority tier may preempt lower tiers to get
its first chunk in; (2) running sequences in priority order (higher tier, then earlier
arrival) get their next chunk / decode token, preempting from the tail of that order
(lowest tier, latest arrival) when blocks run out; (3) if nothing was preempted for lack of
blocks, swapped sequences come back, then (4) waiting ones are admitted FCFS per tier,
with prefix-cache hits and the free-block watermark. Preemption swaps long sequences
(>= swap_threshold_tokens) to the CPU pool and recomputes short ones.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from draftsmith.serve_eval.engine.kv_cache_manager import KVCacheManager, cdiv
from draftsmith.serve_eval.engine.request import Sequence, SequenceStatus
from draftsmith.serve_eval.engine.sampling_params import SamplingParams


@dataclass
class _StepPlan:
    """What one schedule() call has decided so far, and the token budget it has left."""
    budget: int
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    lookaheads: list[int] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    def take(self, seq: Sequence, n: int, lookahead: int) -> None:
        self.seqs.append(seq)
        self.num_tokens.append(n)
        self.lookaheads.append(lookahead)
        self.budget -= n + lookahead


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    prefill_chunk_size: int = 512
    swap_threshold_tokens: int = 512

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "prefill_chunk_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.swap_threshold_tokens < 0:
            raise ValueError(f"swap_threshold_tokens must be >= 0, got {self.swap_threshold_tokens}")


class SchedulerOutput(NamedTuple):
    seqs: list[Sequence]                      # scheduled this step, in batch order
    num_scheduled_tokens: list[int]           # tokens of seq.token_ids to run, per seq
    num_lookahead_tokens: list[int]           # extra KV slots reserved for draft tokens, per seq
    num_batched_tokens: int                   # sum of the two above (the budget spent)
    blocks_to_swap_out: list[tuple[int, int]] # (gpu, cpu); run first
    blocks_to_copy: list[tuple[int, int]]     # (src, dst) copy-on-write; run second
    blocks_to_swap_in: list[tuple[int, int]]  # (cpu, gpu); run third
    preempted: list[Sequence]

    @property
    def is_empty(self) -> bool:
        return not self.seqs


def _order_key(seq: Sequence) -> tuple[int, float, int]:
    return (-seq.priority, seq.arrival_time, seq.seq_id)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: list[Sequence] = []   # kept sorted by _order_key
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.num_preemptions = 0
        self.num_swap_preemptions = 0

    # -- queue management --------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self._push_waiting(seq)

    def _push_waiting(self, seq: Sequence) -> None:
        key = _order_key(seq)
        i = len(self.waiting)
        while i > 0 and _order_key(self.waiting[i - 1]) > key:   # usually appends at the end
            i -= 1
        self.waiting.insert(i, seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark finished and free its blocks at once; removal from queues is lazy for
        running sequences (see drop_finished) so finishing many is O(n) per step."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.kv.free(seq)

    def drop_finished(self) -> None:
        self.running = [s for s in self.running if s.status is SequenceStatus.RUNNING]

    def fork(self, parent: Sequence, request_id: str, params: SamplingParams | None = None,
             generator: torch.Generator | None = None) -> Sequence:
        """A running copy of `parent` sharing its blocks (copy-on-write on the next write)."""
        assert parent.status is SequenceStatus.RUNNING, "only running sequences fork"
        child = parent.fork(request_id, params, generator)
        self.kv.fork(parent, child)
        child.status = SequenceStatus.RUNNING
        self.running.append(child)
        return child

    def abort(self, seq: Sequence) -> None:
        for queue in (self.waiting, self.running, self.swapped):
            if seq in queue:
                queue.remove(seq)
        self.finish(seq, "abort")

    # -- preemption ----------------------------------------------------------------------
    def _preempt(self, seq: Sequence, swap_out: list[tuple[int, int]]) -> None:
        self.num_preemptions += 1
        if seq.num_computed_tokens >= self.config.swap_threshold_tokens and self.kv.can_swap_out(seq):
            swap_out.extend(self.kv.swap_out(seq))
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
            self.num_swap_preemptions += 1
        else:  # recompute: forget the KV, keep the tokens (prompt + outputs so far)
            self.kv.free(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            self._push_waiting(seq)

    def _next_chunk(self, seq: Sequence, budget: int) -> tuple[int, int]:
        """(tokens to compute, lookahead slots) for seq within `budget`."""
        remaining = seq.num_tokens - seq.num_computed_tokens
        num_new = min(remaining, self.config.prefill_chunk_size, budget)
        # The first output token is always a plain sample of the prompt's last row, however the prompt
        # was chunked: an n > 1 request draws its n first tokens from that one row (parallel_sampling).
        decoding = remaining == 1 and seq.num_output_tokens > 0
        lookahead = min(seq.num_lookahead_tokens, budget - num_new) if decoding else 0
        return num_new, lookahead

    def _priority_preemption(self, swap_out: list, preempted: list) -> None:
        """Let the head of the waiting queue evict running sequences of lower tiers."""
        if not self.waiting or not self.running:
            return
        head = self.waiting[0]
        order = sorted(self.running, key=_order_key)
        need = cdiv(min(head.num_tokens, self.config.prefill_chunk_size), self.kv.block_size)
        while (order and order[-1].priority < head.priority
               and self.kv.pool.num_free_blocks - self.kv.watermark_blocks < need):
            victim = order.pop()
            self.running.remove(victim)
            self._preempt(victim, swap_out)
            preempted.append(victim)

    # -- the step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        plan = _StepPlan(self.config.max_num_batched_tokens)
        self._priority_preemption(plan.swap_out, plan.preempted)
        out_of_blocks = self._schedule_running(plan)
        if not out_of_blocks:
            self._schedule_swapped(plan)
            self._schedule_waiting(plan)
        return SchedulerOutput(plan.seqs, plan.num_tokens, plan.lookaheads,
                               self.config.max_num_batched_tokens - plan.budget, plan.swap_out,
                               self.kv.take_pending_copies(), plan.swap_in, plan.preempted)

    def _schedule_running(self, plan: "_StepPlan") -> bool:
        """(2) running sequences, highest tier / earliest arrival first; out of blocks, the lowest tier
        and latest arrival is preempted. Returns whether blocks ran out (then nothing else is admitted)."""
        order = sorted(self.running, key=_order_key)
        still_running: list[Sequence] = []
        out_of_blocks = False
        i = 0
        while i < len(order):
            seq = order[i]
            i += 1
            if plan.budget <= 0:
                still_running.append(seq)
                continue
            n, la = self._next_chunk(seq, plan.budget)
            if n + la == 0:   # nothing to compute (e.g. waiting on a strategy); keep its blocks
                still_running.append(seq)
                continue
            while not self.kv.allocate_slots(seq, n, la):
                out_of_blocks = True
                victim = order.pop() if len(order) > i else seq   # lowest tier, latest arrival
                self._preempt(victim, plan.swap_out)
                plan.preempted.append(victim)
                if victim is seq:
                    break
            else:
                plan.take(seq, n, la)
                still_running.append(seq)
        self.running = still_running
        return out_of_blocks

    def _num_seqs_running(self) -> int:
        """Running sequences as max_num_seqs counts them: an unforked n > 1 request counts its n samples."""
        return sum(seq.num_pending_samples for seq in self.running)

    def _schedule_swapped(self, plan: "_StepPlan") -> None:
        """(3) swapped sequences return before any new admission."""
        for seq in sorted(self.swapped, key=_order_key):
            if plan.budget <= 0 or self._num_seqs_running() + seq.num_pending_samples > self.config.max_num_seqs:
                break
            n, la = self._next_chunk(seq, plan.budget)
            extra = cdiv(seq.num_computed_tokens + n + la, self.kv.block_size) - len(self.kv.cpu_tables[seq.seq_id])
            if not self.kv.can_swap_in(seq, max(extra, 0)):
                break
            plan.swap_in.extend(self.kv.swap_in(seq))
            self.swapped.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            ok = self.kv.allocate_slots(seq, n, la)
            assert ok, "swap-in reserved room for the next chunk"
            plan.take(seq, n, la)

    def _schedule_waiting(self, plan: "_StepPlan") -> None:
        """(4) waiting sequences, FCFS within a tier; a higher tier may pass swapped ones."""
        top_swapped = max((s.priority for s in self.swapped), default=None)
        num_running = self._num_seqs_running()
        while self.waiting and plan.budget > 0:
            seq = self.waiting[0]
            if num_running + seq.num_pending_samples > self.config.max_num_seqs:
                break
            if top_swapped is not None and seq.priority <= top_swapped:
                break
            assert seq.num_computed_tokens == 0, "waiting sequences hold no KV"
            hits = self.kv.lookup_prefix(seq)
            remaining = seq.num_tokens - len(hits) * self.kv.block_size
            n = min(remaining, self.config.prefill_chunk_size, plan.budget)
            if not self.kv.allocate_slots(seq, n, 0, computed_blocks=hits, admit=True):
                break
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            num_running += seq.num_pending_samples
            plan.take(seq, n, 0)
