"""SpeculativeStrategy: the engine's StepStrategy for speculative decoding (propose -> verify -> keep).

One step, for the whole scheduled batch:
1. before_schedule: the policy picks K per running sequence (per domain, fallback may say 0); the
   sequence reserves that many lookahead KV slots (the node budget for trees).
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
6. proposer.on_accepted, then proposer.add_features (needs_hidden), metrics and policy updates.
Finished / aborted / recompute-preempted requests are reset in the proposer.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from kernels.sampling import logits_to_probs
from serve_eval.engine.llm_engine import StepResult
from serve_eval.engine.request import Sequence, SequenceStatus
from serve_eval.engine.scheduler import SchedulerOutput
from serve_eval.spec.metrics import SpecMetrics
from serve_eval.spec.policy import SpecPolicy
from serve_eval.spec.proposers.base import Proposal, TargetFeatures
from serve_eval.spec.verify import VerifyResult, verify_batch

if TYPE_CHECKING:
    from serve_eval.engine.llm_engine import LLMEngine
    from serve_eval.spec.config import SpecConfig


class _Draft:
    """One sequence's proposal as verified this step: tokens, parents, draft rows."""

    __slots__ = ("index", "tokens", "parents", "draft_probs", "point_mass", "depth", "is_tree")

    def __init__(self, index: int, proposal: Proposal, limit: int) -> None:
        self.index = index  # position in the scheduled batch
        tree = proposal.tree
        n = min(proposal.num_tokens, limit)  # node order is topological: a prefix keeps ancestors
        self.is_tree = tree is not None
        if tree is not None:
            self.tokens, self.parents = tree.tokens[:n], tree.parents[:n]
            self.depth = int(tree.depths[:n].max()) if n else 0
            self.draft_probs = None if tree.draft_probs is None else tree.draft_probs[:n]
            pm = tree.point_mass
            self.point_mass = None if pm is None else pm[:n]
        else:
            self.tokens = proposal.tokens[:n]
            self.parents = torch.arange(n, dtype=torch.int64) - 1
            self.depth = n
            self.draft_probs = None if proposal.draft_probs is None else proposal.draft_probs[:n]
            self.point_mass = None

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.numel())

    def positions(self, root_position: int) -> Tensor:  # int64 [N+1]: [root, nodes...] by depth
        depths = torch.zeros(self.num_nodes + 1, dtype=torch.int64)
        for i, parent in enumerate(self.parents.tolist()):
            depths[i + 1] = depths[parent + 1] + 1
        return depths + root_position

    def mask(self) -> Tensor:  # bool [N+1, N+1]: row r sees itself and its ancestors (0 = root)
        size = self.num_nodes + 1
        anc = torch.eye(size, dtype=torch.bool)
        anc[:, 0] = True
        for i, parent in enumerate(self.parents.tolist()):
            anc[i + 1] |= anc[parent + 1]
        return anc


class SpeculativeStrategy:
    def __init__(self, config: "SpecConfig", proposer, engine: "LLMEngine | None" = None) -> None:
        # engine is unused here (the engine passes itself to every hook); tests build a strategy
        # around a custom proposer before the engine exists: LLMEngine(cfg, strategy=...).
        self.config = config
        self.proposer = proposer
        self.policy = SpecPolicy(config.policy)
        self.metrics = SpecMetrics()
        self.max_lookahead_tokens = config.max_lookahead_tokens
        self.needs_hidden = bool(getattr(proposer, "needs_hidden", False))
        self.aux_layers = tuple(getattr(proposer, "aux_layers", ()))
        self._tracked: dict[str, Sequence] = {}  # requests the proposer may hold state for
        self._k: dict[str, int] = {}  # K the policy chose for each sequence this step
        self._attached = False
        self.draft_time_s = 0.0  # propose + proposer callbacks
        self.target_time_s = 0.0  # target forward + probs + verify of steps with drafts

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

    def before_schedule(self, engine: "LLMEngine") -> None:
        if not self._attached:
            attach = getattr(self.proposer, "attach", None)
            if attach is not None:
                attach(engine)
            self._attached = True
        for seq in [s for s in self._tracked.values() if s.is_finished]:  # aborted between steps
            self._release(seq)
        for seq in (*engine.scheduler.running, *engine.scheduler.swapped):
            k = self._num_speculative_tokens(engine, seq)
            self._k[seq.request_id] = k
            if k == 0:
                seq.num_lookahead_tokens = 0
            else:
                room = engine.max_model_len - seq.num_tokens  # draft positions stay inside the model
                slots = self.config.max_draft_nodes if self.config.uses_tree else k
                seq.num_lookahead_tokens = max(0, min(slots, room))

    def _num_speculative_tokens(self, engine: "LLMEngine", seq: Sequence) -> int:
        k = self.policy.num_speculative_tokens(seq.domain)
        # Drafts past max_tokens could never be emitted (the bonus token covers the last one).
        return max(0, min(k, seq.params.max_tokens - seq.num_output_tokens - 1))

    # -- the step ------------------------------------------------------------------------
    def execute(self, engine: "LLMEngine", out: SchedulerOutput) -> StepResult:
        for seq in out.preempted:
            # Recompute preemption drops the target KV, so the draft state goes too. A swapped
            # sequence keeps both (its target KV comes back as it was).
            if seq.status is SequenceStatus.WAITING and seq.request_id in self._tracked:
                self.proposer.reset(seq.request_id)
        for seq in out.seqs:
            self._tracked[seq.request_id] = seq

        # 1. propose for decode sequences that got lookahead slots
        spec_idx = [i for i, la in enumerate(out.num_lookahead_tokens) if la > 0]
        drafts: dict[int, _Draft] = {}
        draft_time = 0.0
        if spec_idx:
            seqs = [out.seqs[i] for i in spec_idx]
            ks = [max(1, min(self._k.get(s.request_id, 1), out.num_lookahead_tokens[i]))
                  if not self.config.uses_tree else max(1, self._k.get(s.request_id, 1))
                  for s, i in zip(seqs, spec_idx)]
            t0 = time.perf_counter()
            proposals = self.proposer.propose(seqs, ks)
            draft_time += time.perf_counter() - t0
            if len(proposals) != len(seqs):
                raise ValueError(f"proposer returned {len(proposals)} proposals for {len(seqs)} sequences")
            for i, proposal in zip(spec_idx, proposals):
                proposal.validate(engine.executor.vocab_size)
                if proposal.tree is not None:
                    self.config.check_tree(proposal.tree.num_nodes)
                d = _Draft(i, proposal, out.num_lookahead_tokens[i])
                if d.num_nodes:
                    drafts[i] = d

        # 2. one target forward over all scheduled tokens
        t_target = time.perf_counter()
        extra = [drafts[i].tokens.tolist() if i in drafts else [] for i in range(len(out.seqs))]
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
        forward_time = time.perf_counter() - t_target
        engine.forward_time_s += forward_time

        # 3. sample / verify
        new_tokens: list[list[int]] = [[] for _ in out.seqs]
        results: dict[int, VerifyResult] = {}
        offsets, row = {}, 0
        for i in producing:
            offsets[i] = row
            row += 1 + (drafts[i].num_nodes if i in drafts else 0)
        plain = [i for i in producing if i not in drafts]
        if plain:
            sel = torch.tensor([offsets[i] for i in plain], device=fwd.logits.device)
            for i, tok in zip(plain, engine.sample([out.seqs[i] for i in plain], fwd.logits[sel])):
                new_tokens[i] = [tok]
        if drafts:
            results = self._verify(engine, out, drafts, fwd.logits, offsets)
            self._compact(engine, batch.meta.slot_mapping, drafts, results, cu)
            for i, res in results.items():
                new_tokens[i] = list(res.accepted_tokens)
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
        return StepResult(new_tokens, rejected)

    def _tree_inputs(self, out, batch, drafts: dict[int, _Draft], cu: list[int]) -> tuple[Tensor, Tensor]:
        """Positions by depth for tree rows and a [T, max_q] mask: causal rows, ancestor rows for trees."""
        positions = batch.positions.clone()
        max_q = batch.meta.max_seqlen_q
        mask = torch.ones(max_q, max_q, dtype=torch.bool).tril_()[
            torch.cat([torch.arange(q) for q in batch.query_lens])]
        for i, d in drafts.items():
            if not d.is_tree:
                continue
            start, q = cu[i], cu[i + 1] - cu[i]  # decode: the root is the only scheduled token
            root_pos = out.seqs[i].num_computed_tokens
            positions[start:start + q] = d.positions(root_pos).to(positions.device)
            mask[start:start + q] = False
            mask[start:start + q, :q] = d.mask()
        return positions, mask.to(batch.meta.slot_mapping.device)

    def _verify(self, engine, out, drafts: dict[int, _Draft], logits: Tensor, offsets: dict[int, int]):
        order = sorted(drafts)
        seqs = [out.seqs[i] for i in order]
        width = max(drafts[i].num_nodes for i in order)
        vocab = logits.shape[1]
        dev = logits.device
        # Target distributions of every verified row, with each request's params.
        row_index, temps, top_ks, top_ps = [], [], [], []
        for i, seq in zip(order, seqs):
            n = drafts[i].num_nodes + 1
            row_index.extend(range(offsets[i], offsets[i] + n))
            temps += [seq.params.temperature] * n
            top_ks += [seq.params.top_k] * n
            top_ps += [seq.params.top_p] * n
        probs = logits_to_probs(logits[torch.tensor(row_index, device=dev)], temps, top_ks, top_ps)
        batch = len(order)
        tokens = torch.zeros(batch, width, dtype=torch.int64, device=dev)
        parents = torch.full((batch, width), -1, dtype=torch.int64, device=dev)
        target = torch.zeros(batch, width + 1, vocab, dtype=probs.dtype, device=dev)
        any_dense = any(drafts[i].draft_probs is not None for i in order)
        draft_probs = torch.zeros(batch, width, vocab, device=dev) if any_dense else None
        point_mass = torch.ones(batch, width, dtype=torch.bool, device=dev)
        num_nodes = torch.tensor([drafts[i].num_nodes for i in order], dtype=torch.int64, device=dev)
        start = 0
        for b, i in enumerate(order):
            d = drafts[i]
            n = d.num_nodes
            tokens[b, :n] = d.tokens.to(dev)
            parents[b, :n] = d.parents.to(dev)
            target[b, :n + 1] = probs[start:start + n + 1]
            start += n + 1
            if d.draft_probs is not None:
                if d.draft_probs.shape[-1] != vocab:
                    raise ValueError(f"draft_probs vocab {d.draft_probs.shape[-1]} != target vocab {vocab} "
                                     f"(request {out.seqs[i].request_id!r})")
                draft_probs[b, :n] = d.draft_probs.to(dev, torch.float32)
                point_mass[b, :n] = False if d.point_mass is None else d.point_mass.to(dev)
        greedy = [s.params.temperature == 0 for s in seqs]
        generators = [s.generator or engine.generator for s in seqs]
        res = verify_batch(tokens, parents, target, greedy, generators, draft_probs, point_mass, num_nodes)
        return dict(zip(order, res.to_results()))

    @staticmethod
    def _compact(engine, slot_mapping: Tensor, drafts, results, cu: list[int]) -> None:
        """Copy the accepted path's KV (node slots) into the slots right after the root."""
        src, dst = [], []
        for i, res in results.items():
            for depth, node in enumerate(res.accepted_node_ids):
                if node != depth:
                    src.append(cu[i] + 1 + node)
                    dst.append(cu[i] + 1 + depth)
        if src:
            index = torch.tensor(src + dst, device=slot_mapping.device)
            slots = slot_mapping[index]
            engine.executor.copy_slots(slots[:len(src)], slots[len(src):])

    def _feed_features(self, out, fwd, cu: list[int], drafts, results) -> None:
        for i, (seq, n) in enumerate(zip(out.seqs, out.num_scheduled_tokens)):
            if i in results:  # root + accepted nodes, in path order (= their compacted positions)
                rows = [cu[i]] + [cu[i] + 1 + node for node in results[i].accepted_node_ids]
            else:  # prefill chunk, or a plain decode root
                rows = list(range(cu[i], cu[i] + n))
            index = torch.tensor(rows, device=fwd.hidden.device)
            aux = None
            if self.aux_layers:
                aux = torch.cat([fwd.aux_hidden[layer].index_select(0, index) for layer in self.aux_layers], dim=-1)
            self.proposer.add_features(seq.request_id, TargetFeatures(seq.num_computed_tokens,
                                                                      fwd.hidden.index_select(0, index), aux))

    def _record(self, engine, out, drafts, results, draft_time: float, target_time: float) -> None:
        for seq, n, la in zip(out.seqs, out.num_scheduled_tokens, out.num_lookahead_tokens):
            if la == 0 and n == 1 and seq.num_computed_tokens + 1 == seq.num_tokens:  # a plain decode step
                self.policy.observe_non_spec_step(seq.domain)   # counts toward a probe only while off
        if not results:
            return
        self.draft_time_s += draft_time
        self.target_time_s += target_time
        share = 1.0 / len(results)  # batch times split evenly over this step's rounds
        proposed = 0
        for i, res in results.items():
            seq, d = out.seqs[i], drafts[i]
            self.metrics.record_round(seq.request_id, seq.domain, d.num_nodes, res.num_accepted_drafts,
                                      draft_time * share, target_time * share, d.depth)
            self.policy.observe_round(seq.domain, d.depth, res.num_accepted_drafts)
            seq.spec_stats = self.metrics.by_request[seq.request_id]
            proposed += d.num_nodes
        if self.config.policy.adaptive_k and target_time > 0:
            self.policy.observe_cost_ratio((draft_time / proposed) / (target_time / len(results)))

    # -- stats -----------------------------------------------------------------------------
    def stats(self) -> dict:
        return {"method": self.config.method, **self.metrics.to_dict(), "policy": self.policy.to_dict(),
                "draft_time_s": self.draft_time_s, "target_time_s": self.target_time_s}
