"""SpeculativeStrategy: the engine's StepStrategy for speculative decoding (propose -> verify -> keep).

One step, for the whole scheduled batch:
1. before_schedule: the policy picks K per running sequence (per domain, fallback may say 0); the
   sequence reserves that many lookahead KV slots (the node budget for trees). A proposer with a
   tree_budget gets its verify cost curve probed once, at attach, before any KV is written.
2. propose: one proposer call for every decode sequence that got lookahead slots.
3. one target forward over everything scheduled, flattened: prefill chunks of some sequences,
   [root, drafts...] of others (tree rows get an ancestor mask and positions by depth), with the
   hidden / aux features when the proposer needs them.
4. logits_to_probs with each request's params on every verified row, then verify_batch (greedy for
   temperature 0, exact rejection sampling otherwise). Sequences without drafts sample exactly as
   the non-speculative engine does (engine.sample).
5. compaction: the accepted tree path's KV is copied into the slots right after the root, so that
   rolling back the rest (the engine does that from num_rejected_slots) leaves exactly the accepted
   tokens' KV in place.
6. proposer.on_accepted, then proposer.add_feature_batch (needs_hidden), metrics and policy updates; the
   tree budget learns from each verified tree and from the step's measured cost.
Finished / aborted / recompute-preempted requests are reset in the proposer.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from draftsmith.serve_eval.engine.llm_engine import StepResult
from draftsmith.serve_eval.engine.logprobs import rows_logprobs
from draftsmith.serve_eval.engine.min_tokens import mask_early_stops
from draftsmith.serve_eval.engine.request import Sequence, SequenceStatus
from draftsmith.serve_eval.engine.scheduler import SchedulerOutput
from draftsmith.serve_eval.speculative.batch_gate import BatchGate
from draftsmith.serve_eval.speculative.metrics import DEFAULT_DOMAIN, SpecEngineStats, SpecMetrics
from draftsmith.serve_eval.speculative.policy import SpecPolicy
from draftsmith.serve_eval.speculative.round_logprobs import round_rows
from draftsmith.serve_eval.speculative.proposers.base import FeatureBatch, Proposal
from draftsmith.serve_eval.speculative.round_verify import RoundOutcome, SpecDraft, verify_round
from draftsmith.serve_eval.speculative.tree import DraftTree
from draftsmith.serve_eval.speculative.tree_budget import probe_token_counts, probe_verify_costs
from draftsmith.serve_eval.speculative.verify import VerifyResult

if TYPE_CHECKING:
    from draftsmith.serve_eval.engine.llm_engine import LLMEngine
    from draftsmith.serve_eval.speculative.config import SpecConfig


def _as_draft(index: int, proposal: Proposal, limit: int) -> SpecDraft:
    """The part of a proposal that fits the sequence's reserved slots; a chain becomes a chain tree."""
    n = min(proposal.num_tokens, limit)  # node order is topological: a prefix keeps ancestors
    if proposal.tree is not None:
        return SpecDraft(index, proposal.tree.prefix(n), True)
    probs = None if proposal.draft_probs is None else proposal.draft_probs[:n]
    return SpecDraft(index, DraftTree.chain(proposal.tokens[:n], probs), False)


class SpeculativeStrategy:
    def __init__(self, config: "SpecConfig", proposer, engine: "LLMEngine | None" = None) -> None:
        # engine is unused here (the engine passes itself to every hook); tests build a strategy
        # around a custom proposer before the engine exists: LLMEngine(cfg, strategy=...).
        self.config = config
        self.proposer = proposer
        self.policy = SpecPolicy(config.policy, measured_gate=config.batch_gate.mode == "measured")
        self.batch_gate = BatchGate(config.batch_gate)
        self._batch_size = 0                # decoding sequences this step (what the batch gate sees)
        self._batch_cap: int | None = None  # the gate's K cap for this step
        self.metrics = SpecMetrics()
        self.max_lookahead_tokens = config.max_lookahead_tokens
        self.needs_hidden = bool(proposer.needs_hidden)   # declared by the Proposer protocol
        self.aux_layers = tuple(proposer.aux_layers)
        self._tracked: dict[str, Sequence] = {}  # requests the proposer may hold state for
        self._k: dict[str, int] = {}  # K the policy chose for each sequence this step
        self._attached = False
        self.draft_time_s = 0.0  # propose + proposer callbacks
        self.target_time_s = 0.0  # target forward + probs + verify of steps with drafts
        self._speculated_last_step = False   # whether the previous step ran rounds (its draft is caught up)

    # -- lifecycle ---------------------------------------------------------------------
    def _release(self, seq: Sequence) -> None:
        """Finished or aborted: the proposer forgets it, its live stats leave the metrics map."""
        self._tracked.pop(seq.request_id, None)
        self._k.pop(seq.request_id, None)
        self.proposer.reset(seq.request_id)
        self.metrics.pop_request(seq.request_id)

    def after_step(self, engine: "LLMEngine", out: SchedulerOutput, outputs) -> None:
        for seq in out.seqs:
            if seq.is_finished and seq.request_id in self._tracked:
                self._release(seq)

    def on_fork(self, parent: Sequence, children: list[Sequence]) -> None:
        """Parallel sampling forked `parent` after its first token: each child starts from the proposer's
        state for the parent (the prompt's target features), as a separate request would have it."""
        for child in children:
            self.proposer.fork(parent.request_id, child.request_id)
            self._tracked[child.request_id] = child   # released with the others when it finishes

    def before_schedule(self, engine: "LLMEngine") -> None:
        if not self._attached:
            self.proposer.attach(engine)
            self._probe_tree_costs(engine)
            self._attached = True
        for seq in [s for s in self._tracked.values() if s.is_finished]:  # aborted between steps
            self._release(seq)
        self._batch_size = len(engine.scheduler.running)
        self._batch_cap = self.batch_gate.cap(self._batch_size)
        for seq in (*engine.scheduler.running, *engine.scheduler.swapped):
            k = self._num_speculative_tokens(engine, seq)
            self._k[seq.request_id] = k
            if k == 0:
                seq.num_lookahead_tokens = 0
            else:
                room = engine.max_model_len - seq.num_tokens  # draft positions stay inside the model
                slots = self.config.max_draft_nodes if self.config.uses_tree else k
                seq.num_lookahead_tokens = max(0, min(slots, room))

    def _probe_tree_costs(self, engine: "LLMEngine") -> None:
        """The target's forward timed at a tree's query lengths, while no KV block holds anything yet; one
        probe serves every cost model of the proposer (the curve is the target's, whichever draft proposes)."""
        budgets = [b for b in self.proposer.tree_budgets() if b.curve is None]
        pool = engine.kv.pool
        if not budgets or pool.num_used_blocks or pool.num_cached_free:
            return
        cap = min(engine.config.max_num_batched_tokens, engine.config.max_num_seqs * (1 + self.config.max_draft_nodes))
        curve = probe_verify_costs(engine.executor, engine.kv.block_size, engine.kv.num_gpu_blocks,
                                   probe_token_counts(self.config.max_draft_nodes, cap),
                                   max(b.config.probe_repeats for b in budgets))
        for budget in budgets:
            budget.curve = curve

    def _num_speculative_tokens(self, engine: "LLMEngine", seq: Sequence) -> int:
        k = self.policy.num_speculative_tokens(seq.domain)
        if self._batch_cap is not None:
            k = min(k, self._batch_cap)
        cap = self.proposer.max_tokens_for(seq)   # a routed proposer's per-request K (0: plain)
        if cap is not None:
            k = min(k, cap)
        # Drafts past max_tokens could never be emitted (the bonus token covers the last one).
        return max(0, min(k, seq.params.max_tokens - seq.num_output_tokens - 1))

    # -- the step ------------------------------------------------------------------------
    def execute(self, engine: "LLMEngine", out: SchedulerOutput) -> StepResult:
        t_step = time.perf_counter()
        for seq in out.preempted:
            # Recompute preemption drops the target KV, so the draft state goes too. A swapped
            # sequence keeps both (its target KV comes back as it was).
            if seq.status is SequenceStatus.WAITING and seq.request_id in self._tracked:
                self.proposer.reset(seq.request_id)
        for seq in out.seqs:
            self._tracked[seq.request_id] = seq

        # 1. propose for decode sequences that got lookahead slots
        spec_idx = [i for i, la in enumerate(out.num_lookahead_tokens) if la > 0]
        drafts, draft_time = self._propose(engine, out, spec_idx)

        # 2. one target forward over all scheduled tokens, then 3. sample / verify
        t_target = time.perf_counter()
        fwd, cu, slot_mapping, producing = self._target_forward(engine, out, drafts)
        engine.forward_time_s += time.perf_counter() - t_target
        new_tokens, results = self._sample_and_verify(engine, out, drafts, fwd.logits, producing, slot_mapping, cu)
        target_time = time.perf_counter() - t_target

        # 4. proposer callbacks: accepted path, then the target features of the kept rows
        t0 = time.perf_counter()
        for i in spec_idx:
            seq = out.seqs[i]
            res = results.get(i) or VerifyResult(new_tokens[i], 0, [])
            self.proposer.on_accepted(seq.request_id, res)
        if self.needs_hidden:
            self._feed_features(out, fwd, cu, drafts, results)
        draft_time += time.perf_counter() - t0

        # 5. bookkeeping: rejected slots, metrics, policy
        rejected = [0] * len(out.seqs)
        for i in spec_idx:
            rejected[i] = out.num_lookahead_tokens[i] - (results[i].num_accepted_drafts if i in results else 0)
        self._record(engine, out, drafts, results, draft_time, target_time)
        self._observe_step(out, drafts, new_tokens, time.perf_counter() - t_step)
        logprobs = rows_logprobs(out.seqs, fwd.logits, round_rows(producing, drafts, results), new_tokens)
        return StepResult(new_tokens, rejected, logprobs)

    def _target_forward(self, engine: "LLMEngine", out: SchedulerOutput, drafts: dict[int, SpecDraft]):
        """One flattened forward: prefill chunks, decode roots, and [root, drafts...] (tree rows with an
        ancestor mask and positions by depth). Returns (forward output, cu_seqlens, slot_mapping, the
        indices of the sequences that produce a token this step)."""
        extra = [drafts[i].tree.tokens.tolist() if i in drafts else [] for i in range(len(out.seqs))]
        batch = engine.prepare_batch(out, extra)
        cu = batch.meta.cu_seqlens_q.tolist()
        positions = batch.positions
        if any(d.is_tree for d in drafts.values()):
            positions, batch.meta.tree_mask = self._tree_inputs(out, batch, drafts, cu)
        rows: list[int] = []  # logits rows, per producing seq: its verify rows (or its last row)
        producing: list[int] = []
        for i, (seq, n) in enumerate(zip(out.seqs, out.num_scheduled_tokens)):
            if seq.num_computed_tokens + n == seq.num_tokens:
                producing.append(i)
                rows.extend(range(cu[i], cu[i + 1]) if i in drafts else [cu[i + 1] - 1])
        dev = engine.executor.device
        fwd = engine.executor.forward(batch.input_ids, positions, batch.meta,
                                      torch.tensor(rows, dtype=torch.int64, device=dev),
                                      self.aux_layers if self.needs_hidden else ())
        return fwd, cu, batch.meta.slot_mapping, producing

    def _sample_and_verify(self, engine: "LLMEngine", out: SchedulerOutput, drafts: dict[int, SpecDraft],
                           logits: Tensor, producing: list[int], slot_mapping: Tensor,
                           cu: list[int]) -> tuple[list[list[int]], dict[int, VerifyResult]]:
        """Sequences without drafts sample exactly as the plain engine does; the rest are verified, and
        their accepted tree paths compacted into the slots after the root."""
        new_tokens: list[list[int]] = [[] for _ in out.seqs]
        results: dict[int, VerifyResult] = {}
        offsets, row = {}, 0
        for i in producing:
            offsets[i] = row
            row += 1 + (drafts[i].num_nodes if i in drafts else 0)
        mask_early_stops(logits, [(out.seqs[i], offsets[i], drafts[i].tree.depths if i in drafts else None)
                                  for i in producing], engine.eos_token_ids)
        plain = [i for i in producing if i not in drafts]
        if plain:
            # a step without drafts (a gate decoding plainly) samples every row as they are, as the plain engine does
            rows = logits if not drafts else logits[torch.tensor([offsets[i] for i in plain], device=logits.device)]
            for i, tok in zip(plain, engine.sample([out.seqs[i] for i in plain], rows)):
                new_tokens[i] = [tok]
        if drafts:
            outcome = self._verify(engine, out, drafts, logits, offsets)
            results = outcome.results
            self._calibrate(out, drafts, results)
            self._compact(engine, slot_mapping, outcome, cu)
            for i, res in results.items():
                new_tokens[i] = list(res.accepted_tokens)
        return new_tokens, results

    def _calibrate(self, out: SchedulerOutput, drafts: dict[int, SpecDraft], results: dict[int, VerifyResult]) -> None:
        """Each verified budgeted tree updates the acceptance calibration its nodes were valued by."""
        for i, res in results.items():
            tree = drafts[i].tree
            if tree.cells is None:
                continue
            budget = self.proposer.tree_budget_for(out.seqs[i].request_id)
            if budget is not None:
                budget.observe_round(tree.cells, tree.parents, res.accepted_node_ids)

    def _observe_step(self, out: SchedulerOutput, drafts: dict[int, SpecDraft], new_tokens: list[list[int]],
                      step_s: float) -> None:
        """Feed the batch gate a pure decode step (a prefill chunk in it would blur its cost per token)."""
        if any(n > 1 and i not in drafts for i, n in enumerate(out.num_scheduled_tokens)):
            return
        emitted = sum(map(len, new_tokens))
        self.batch_gate.observe_step(self._batch_size, bool(drafts), step_s, emitted)
        if drafts:
            self._observe_tree_costs(out, drafts, new_tokens, step_s)

    def _observe_tree_costs(self, out: SchedulerOutput, drafts: dict[int, SpecDraft], new_tokens: list[list[int]],
                            step_s: float) -> None:
        """Each cost model gets its own requests' share of the step: their count, tokens and nodes, and the
        step's seconds split by sequence (the query tokens, where the verify slope is read, are the step's)."""
        members: dict[int, list[int]] = {}  # id(budget) -> sequence indices
        budgets = {}
        for i, seq in enumerate(out.seqs):
            budget = self.proposer.tree_budget_for(seq.request_id)
            if budget is not None:
                budgets[id(budget)] = budget
                members.setdefault(id(budget), []).append(i)
        if not members:
            return
        nodes = {i: d.num_nodes for i, d in drafts.items()}
        query_tokens = len(out.seqs) + sum(nodes.values())
        for key, index in members.items():
            budgets[key].observe_step(len(index), step_s * len(index) / len(out.seqs),
                                      sum(len(new_tokens[i]) for i in index), query_tokens,
                                      sum(nodes.get(i, 0) for i in index),
                                      trees=any(drafts[i].is_tree for i in index if i in drafts))

    def _propose(self, engine: "LLMEngine", out: SchedulerOutput, spec_idx: list[int]) -> tuple[dict[int, SpecDraft], float]:
        """One proposer call for the sequences with lookahead slots -> their non-empty drafts, and its time."""
        drafts: dict[int, SpecDraft] = {}
        if not spec_idx:
            return drafts, 0.0
        seqs = [out.seqs[i] for i in spec_idx]
        ks = [max(1, min(self._k.get(s.request_id, 1), out.num_lookahead_tokens[i]))
              if not self.config.uses_tree else max(1, self._k.get(s.request_id, 1))
              for s, i in zip(seqs, spec_idx)]
        t0 = time.perf_counter()
        proposals = self.proposer.propose(seqs, ks)
        draft_time = time.perf_counter() - t0
        if len(proposals) != len(seqs):
            raise ValueError(f"proposer returned {len(proposals)} proposals for {len(seqs)} sequences")
        for i, proposal in zip(spec_idx, proposals):
            proposal.validate(engine.executor.vocab_size)
            if proposal.tree is not None:
                self.config.check_tree(proposal.tree.num_nodes)
            d = _as_draft(i, proposal, out.num_lookahead_tokens[i])
            if d.num_nodes:
                drafts[i] = d
        return drafts, draft_time

    def _tree_inputs(self, out, batch, drafts: dict[int, SpecDraft], cu: list[int]) -> tuple[Tensor, Tensor]:
        """Positions by depth for tree rows and a [T, max_q] mask: causal rows, ancestor rows for trees."""
        positions = batch.positions.clone()
        max_q = batch.meta.max_seqlen_q
        qlens = torch.tensor(batch.query_lens, dtype=torch.int64)
        starts = torch.tensor(cu[:-1], dtype=torch.int64)
        local = torch.arange(int(qlens.sum())) - starts.repeat_interleave(qlens)  # [T] index within its sequence
        mask = torch.arange(max_q)[None, :] <= local[:, None]  # [T, max_q] causal
        for i, d in drafts.items():
            if not d.is_tree:
                continue
            start, q = cu[i], cu[i + 1] - cu[i]  # decode: the root is the only scheduled token
            positions[start:start + q] = d.tree.positions(out.seqs[i].num_computed_tokens).to(positions.device)
            mask[start:start + q] = False
            mask[start:start + q, :q] = d.tree.ancestors()
        return positions, mask.to(batch.meta.slot_mapping.device)

    def _verify(self, engine, out, drafts: dict[int, SpecDraft], logits: Tensor, offsets: dict[int, int]) -> RoundOutcome:
        generators = [s.generator or engine.generator for s in out.seqs]
        return verify_round(logits, offsets, drafts, out.seqs, generators)

    @staticmethod
    def _compact(engine, slot_mapping: Tensor, outcome: RoundOutcome, cu: list[int]) -> None:
        """Copy the accepted path's KV (node slots) into the slots right after the root."""
        if not outcome.accepted:  # chains only: every accepted node already sits in its depth's slot
            return
        device = slot_mapping.device  # where verification left the accepted nodes (the target's device)
        cu_t = torch.tensor(cu, dtype=torch.int64, device=device)
        src, dst = [], []
        for seq_index, nodes in outcome.accepted:  # nodes [B, D], -1 padded
            nodes = nodes.to(device)
            depth = torch.arange(nodes.shape[1], device=device)
            # The path node at depth index d has id >= d (ids are topological); equal means it already sits
            # in its slot, and padding (-1) never moves.
            move = nodes > depth
            first_slot = cu_t[seq_index.to(device)][:, None] + 1  # [B, 1]: the slot right after each root
            src.append((first_slot + nodes)[move])
            dst.append((first_slot + depth).expand_as(nodes)[move])
        src_t, dst_t = torch.cat(src), torch.cat(dst)
        if src_t.numel():
            slots = slot_mapping[torch.cat([src_t, dst_t])]
            engine.executor.copy_slots(slots[:src_t.numel()], slots[src_t.numel():])

    def _feed_features(self, out, fwd, cu: list[int], drafts, results) -> None:
        """One gather of the kept rows for all sequences, handed over in one add_feature_batch call."""
        rows: list[int] = []  # flat rows of fwd.hidden to keep, sequence after sequence
        counts = []
        for i, (seq, n) in enumerate(zip(out.seqs, out.num_scheduled_tokens)):
            start = len(rows)
            if i in results and drafts[i].is_tree:  # root + the accepted path's node rows, in path order
                rows.append(cu[i])
                rows.extend(cu[i] + 1 + node for node in results[i].accepted_node_ids)
            elif i in results:  # a chain's accepted nodes are 0..n-1: root and nodes are contiguous rows
                rows.extend(range(cu[i], cu[i] + 1 + results[i].num_accepted_drafts))
            else:  # prefill chunk, or a plain decode root
                rows.extend(range(cu[i], cu[i] + n))
            counts.append(len(rows) - start)
        # One index tensor and one gather for the batch (a tensor per sequence costs more than the rows).
        index = torch.tensor(rows, dtype=torch.int64, device=fwd.hidden.device)
        aux = None
        if self.aux_layers:
            aux = torch.cat([fwd.aux_hidden[layer].index_select(0, index) for layer in self.aux_layers], dim=-1)
        self.proposer.add_feature_batch(FeatureBatch([seq.request_id for seq in out.seqs],
                                                     [seq.num_computed_tokens for seq in out.seqs], counts,
                                                     fwd.hidden.index_select(0, index), aux))

    def _record(self, engine, out, drafts, results, draft_time: float, target_time: float) -> None:
        # A probe's wait counts engine steps, once per domain that decoded plainly in the step: counted per
        # sequence, a batch of 16 would re-probe a switched-off draft 16 times as often as batch 1.
        plain_domains = {seq.domain or DEFAULT_DOMAIN
                         for seq, n, la in zip(out.seqs, out.num_scheduled_tokens, out.num_lookahead_tokens)
                         if la == 0 and n == 1 and seq.num_computed_tokens + 1 == seq.num_tokens}
        for domain in sorted(plain_domains):
            self.policy.observe_non_spec_step(domain)   # counts toward a probe only while off
        caught_up, self._speculated_last_step = self._speculated_last_step, bool(results)
        if not results:
            return
        self.draft_time_s += draft_time
        self.target_time_s += target_time
        share = 1.0 / len(results)  # batch times split evenly over this step's rounds
        proposed = 0
        for i, res in results.items():
            seq, d = out.seqs[i], drafts[i]
            depth = d.tree.max_depth if d.is_tree else d.num_nodes
            self.metrics.record_round(seq.request_id, seq.domain, d.num_nodes, res.num_accepted_drafts,
                                      draft_time * share, target_time * share, depth)
            self.policy.observe_round(seq.domain, depth, res.num_accepted_drafts, engine.num_steps)
            seq.spec_stats = self.metrics.by_request[seq.request_id]
            proposed += d.num_nodes
        # adaptive K and the cost-aware fallback bar read c; a first step after plain decoding is not a round's c: its
        # draft first caught up on every token since (a gate's single-step re-tries are all such steps)
        if target_time > 0 and proposed and caught_up:
            self.policy.observe_cost_ratio((draft_time / proposed) / (target_time / len(results)))

    # -- stats -----------------------------------------------------------------------------
    def stats(self) -> SpecEngineStats:
        return SpecEngineStats(self.config.method, self.metrics.total, dict(self.metrics.by_domain),
                               self.policy.to_dict(), self.batch_gate.to_dict(), self.proposer.rounds_by_draft(),
                               self.draft_time_s, self.target_time_s)
