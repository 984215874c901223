"""Several drafts behind one engine: each request is proposed for by the draft its (domain, temperature)
was recommended (serve_eval.eval.recommend), at that recommendation's K.

The eval decides per domain and temperature which (method, K) pays, or that none does; this proposer
holds one child proposer per recommended method and routes every request to its choice. A request
whose choice is "off" gets K = 0 and decodes plainly. The target forward keeps the union of what the
children read (hidden states, aux layers); each child gets its own aux columns. Verification,
rollback and metrics stay the strategy's, exactly as with one draft.

Trees: with a tree config (SpecConfig.tree), a child whose proposer builds that tree mode gets it and the
others propose chains. Each tree-building child keeps its own cost model (tree_budget: its acceptance
calibration is its draft's); the strategy probes the target's verify costs into every one of them and
feeds each request's verified trees and step share to its child's (tree_budgets, tree_budget_for).
"""
from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from draftsmith.serve_eval.eval.recommend import Recommendations, load_recommendations
from draftsmith.serve_eval.speculative.metrics import DEFAULT_DOMAIN
from draftsmith.serve_eval.speculative.proposers.base import (
    Proposal,
    Proposer,
    SequenceView,
    TargetFeatures,
)
from draftsmith.serve_eval.speculative.proposers.registry import proposer_class, register_proposer
from draftsmith.serve_eval.speculative.tree_budget import TreeBudget
from draftsmith.serve_eval.speculative.verify import VerifyResult

if TYPE_CHECKING:
    from draftsmith.serve_eval.engine.llm_engine import LLMEngine
    from draftsmith.serve_eval.speculative.config import SpecConfig


def recommended_k(recs: Recommendations) -> int:
    """The largest K any choice speculates with (the strategy reserves that many slots at most)."""
    every = [c for cs in [recs.default, *recs.domains.values()] for c in cs]
    return max((c.K for c in every if c.speculate), default=1)


@register_proposer("routed")
class RoutedProposer(Proposer):
    supports_tree = True  # children that build the configured tree mode propose trees, the rest chains

    def __init__(self, recs: Recommendations, children: dict[str, Proposer]) -> None:
        self.recs = recs
        self.children = children
        self.needs_hidden = any(c.needs_hidden for c in children.values())
        self.aux_layers = tuple(sorted({layer for c in children.values() for layer in c.aux_layers}))
        self.rounds_by_route: collections.Counter[tuple[str, str]] = collections.Counter()   # (domain, method)
        self._route: dict[str, tuple[str | None, int]] = {}   # request -> (method or None, K)
        self._engine: LLMEngine | None = None

    @classmethod
    def from_spec_config(cls, config: "SpecConfig", engine: "LLMEngine") -> "RoutedProposer":
        recs = load_recommendations(config.routes)
        children: dict[str, Proposer] = {}
        for method, route in sorted(recs.routes().items()):
            # A method label need not be a proposer's name (standalone@int4-g64 runs the standalone proposer
            # on the quantized dir, at the dtype the eval measured it with).
            tree = config.tree if config.tree in proposer_class(route.kind).tree_modes else "none"
            child = replace(config, method=route.kind, draft_path=route.path, routes=None, tree=tree,
                            draft_dtype=route.dtype or config.draft_dtype, num_speculative_tokens=recommended_k(recs))
            children[method] = child.make_proposer(engine)
        return cls(recs, children)

    def attach(self, engine: "LLMEngine") -> None:
        self._engine = engine
        for child in self.children.values():
            child.attach(engine)

    # -- routing ---------------------------------------------------------------------------
    def route(self, seq: SequenceView) -> tuple[str | None, int]:
        """(method, K) for a request; (None, 0) where its recommendation is to decode plainly."""
        cached = self._route.get(seq.request_id)
        if cached is None:
            choice = self.recs.choose(seq.domain, seq.params.temperature)
            cached = (choice.method, choice.K) if choice is not None and choice.speculate else (None, 0)
            self._route[seq.request_id] = cached
        return cached

    def max_tokens_for(self, seq: SequenceView) -> int | None:
        return self.route(seq)[1]

    def rounds_by_draft(self) -> dict[tuple[str, str], int]:
        return dict(self.rounds_by_route)

    def tree_budgets(self) -> tuple[TreeBudget, ...]:
        return tuple(budget for method in sorted(self.children) for budget in self.children[method].tree_budgets())

    def tree_budget_for(self, request_id: str) -> TreeBudget | None:
        child = self._child_of(request_id)
        return None if child is None else child.tree_budget_for(request_id)

    def _child_of(self, request_id: str) -> Proposer | None:
        if request_id not in self._route and self._engine is not None and request_id in self._engine.requests:
            self.route(self._engine.requests[request_id])
        method = self._route.get(request_id, (None, 0))[0]
        return None if method is None else self.children[method]

    # -- the Proposer protocol ---------------------------------------------------------------
    def propose(self, seqs: Sequence[SequenceView], num_tokens: Sequence[int],
                features: Sequence[object] | None = None) -> list[Proposal]:
        groups: dict[str, list[int]] = collections.defaultdict(list)
        for i, seq in enumerate(seqs):
            method, _ = self.route(seq)
            if method is None:
                raise ValueError(f"request {seq.request_id}: routed to plain decoding but asked to propose")
            groups[method].append(i)
        proposals: list[Proposal | None] = [None] * len(seqs)
        for method, index in groups.items():
            made = self.children[method].propose([seqs[i] for i in index], [num_tokens[i] for i in index])
            for i, proposal in zip(index, made):
                proposals[i] = proposal
                self.rounds_by_route[(seqs[i].domain or DEFAULT_DOMAIN, method)] += 1
        return proposals

    def on_accepted(self, request_id: str, result: VerifyResult) -> None:
        child = self._child_of(request_id)
        if child is not None:
            child.on_accepted(request_id, result)

    def reset(self, request_id: str) -> None:
        child = self._child_of(request_id)
        if child is not None:
            child.reset(request_id)
        self._route.pop(request_id, None)

    def fork(self, parent_id: str, child_id: str) -> None:
        if parent_id in self._route:
            self._route[child_id] = self._route[parent_id]
        child = self._child_of(parent_id)
        if child is not None:
            child.fork(parent_id, child_id)

    def add_features(self, request_id: str, features: TargetFeatures) -> None:
        child = self._child_of(request_id)
        if child is None or not child.needs_hidden:
            return
        aux = features.aux
        if aux is not None and child.aux_layers != self.aux_layers:
            width = aux.shape[-1] // len(self.aux_layers)
            columns = [self.aux_layers.index(layer) for layer in child.aux_layers]
            aux = torch.cat([aux[:, c * width:(c + 1) * width] for c in columns], dim=-1) if columns else None
        child.add_features(request_id, TargetFeatures(features.start_pos, features.hidden,
                                                      aux if child.aux_layers else None))

