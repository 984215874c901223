"""The Proposer protocol: what every draft source (standalone, Medusa, EAGLE, n-gram) gives the engine.

Per decode step the engine calls `propose(seqs, num_tokens)` once for the whole running batch and
gets one Proposal per sequence: a chain of up to K tokens or a tree, with the draft distributions
they were drawn from (None = point masses: tokens chosen deterministically, e.g. argmax / top-k /
n-gram lookup). After verification it calls `on_accepted(request_id, result)` so stateful proposers
can keep their draft KV for the accepted path and drop the rest, and `reset(request_id)` when a
request finishes, is aborted or is preempted (its draft state must be rebuilt).

Draft distributions MUST come from `draftsmith.kernels.sampling.logits_to_probs` with the request's own
temperature / top-k / top-p (`sampling_arrays` below) and sampled tokens must be drawn from exactly
those rows; that is what makes rejection sampling exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol, runtime_checkable

import torch
from torch import Tensor

from draftsmith.serve_eval.speculative.tree import DraftTree
from draftsmith.serve_eval.speculative.tree_budget import TreeBudget
from draftsmith.serve_eval.speculative.verify import VerifyResult


class SamplingView(Protocol):
    temperature: float
    top_k: int
    top_p: float


class SequenceView(Protocol):
    """What a proposer may read of a running sequence (engine.request.Sequence satisfies it)."""

    request_id: str
    domain: str | None    # the request's traffic slice (per-domain policy, routing to a draft)
    token_ids: list[int]  # prompt + generated; the last one is the root of the next draft
    params: SamplingView
    generator: torch.Generator | None  # the request's generator: draw draft samples from it


class TargetFeatures(NamedTuple):
    """Target outputs for consecutive positions start_pos .. start_pos + n - 1 of one sequence.

    Handed to proposers with needs_hidden after every target forward (see Proposer.add_features).
    """

    start_pos: int
    hidden: Tensor  # [n, d] final-norm hidden (the lm_head input; Medusa / EAGLE-1 feature)
    aux: Tensor | None = None  # [n, len(aux_layers) * d]: aux hidden states concatenated in aux_layers order


class FeatureBatch(NamedTuple):
    """One step's target features for several sequences, gathered once: sequence j's rows are the j-th of
    ``hidden.split(counts)`` (and of aux), for its positions start_positions[j] onward.

    The tensors are fresh (the strategy gathers them every step) and become the proposer's: it may keep views
    of them instead of copies."""

    request_ids: list[str]
    start_positions: list[int]
    counts: list[int]   # rows per sequence (0: nothing kept this step)
    hidden: Tensor      # [sum(counts), d]
    aux: Tensor | None = None   # [sum(counts), len(aux_layers) * d]

    def per_request(self) -> "list[tuple[str, TargetFeatures]]":
        """(request id, its TargetFeatures): the batch as add_features calls take it."""
        hidden = self.hidden.split(self.counts)
        aux = [None] * len(self.counts) if self.aux is None else self.aux.split(self.counts)
        return [(rid, TargetFeatures(start, h, a))
                for rid, start, h, a in zip(self.request_ids, self.start_positions, hidden, aux)]


class Proposal(NamedTuple):
    tokens: Tensor  # int64 [K] chain tokens (K may be 0: no proposal); for a tree, tree.tokens
    draft_probs: Tensor | None = None  # [K, V] rows the tokens were drawn from; None = point masses
    tree: DraftTree | None = None  # set for tree proposals (then verify with verify_tree)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    def validate(self, vocab_size: int | None = None) -> None:
        """ValueError naming both sides when tokens, probs and tree disagree."""
        if self.tokens.dim() != 1:
            raise ValueError(f"proposal tokens must be 1-D [K], got shape {tuple(self.tokens.shape)}")
        if self.draft_probs is not None:
            k = self.num_tokens
            width = vocab_size if vocab_size is not None else self.draft_probs.shape[-1]
            if self.draft_probs.shape != (k, width):
                raise ValueError(
                    f"proposal draft_probs shape {tuple(self.draft_probs.shape)} does not match "
                    f"{k} tokens x vocab {width}"
                )
        if self.tree is not None and not torch.equal(self.tree.tokens, self.tokens):
            raise ValueError(
                f"proposal tokens {self.tokens.tolist()} differ from its tree's {self.tree.tokens.tolist()}"
            )


def empty_proposal(device: torch.device | str = "cpu") -> Proposal:
    return Proposal(torch.zeros(0, dtype=torch.int64, device=device))


def check_num_tokens(num_tokens: Sequence[int], num_seqs: int) -> None:
    """K per sequence: one per sequence, each > 0 (the engine skips proposing when the policy says 0)."""
    if len(num_tokens) != num_seqs:
        raise ValueError(f"got {len(num_tokens)} num_tokens for {num_seqs} sequences")
    for k in num_tokens:
        if k <= 0:
            raise ValueError(f"num_speculative_tokens (K) must be > 0, got {k}")


def sampling_arrays(seqs: Sequence[SequenceView], device: torch.device | str = "cpu") -> tuple[Tensor, Tensor, Tensor]:
    """(temperature [B], top_k [B], top_p [B]) for logits_to_probs over one draft row per sequence."""
    temperature = torch.tensor([s.params.temperature for s in seqs], dtype=torch.float32, device=device)
    top_k = torch.tensor([s.params.top_k for s in seqs], dtype=torch.int64, device=device)
    top_p = torch.tensor([s.params.top_p for s in seqs], dtype=torch.float32, device=device)
    return temperature, top_k, top_p


@runtime_checkable
class Proposer(Protocol):
    """Subclass it (hooks default to no-ops) or satisfy it structurally.

    Class attributes tell the speculative strategy what to compute for the proposer:
    needs_hidden: the target forward keeps hidden states and the strategy calls add_feature_batch (a subclass
    inherits one that calls add_features per sequence);
    aux_layers: HF hidden_states indices to concatenate into TargetFeatures.aux (EAGLE-3);
    supports_tree: the proposer may return tree proposals (else a tree config is refused);
    tree_modes: the SpecConfig.tree modes it builds trees for (a routed proposer gives a child the tree
    settings only when the child builds that mode, chains otherwise);
    tree_budget: the cost model its dynamic trees are sized by (None: a fixed node budget); the strategy
    feeds it the verified rounds and the measured step costs, through tree_budgets / tree_budget_for
    (a proposer holding several drafts has one budget per draft).
    """

    needs_hidden: bool = False
    aux_layers: tuple[int, ...] = ()
    supports_tree: bool = False
    tree_modes: tuple[str, ...] = ()
    tree_budget: TreeBudget | None = None

    def propose(
        self,
        seqs: Sequence[SequenceView],
        num_tokens: Sequence[int],  # K per sequence (> 0); trees may hold more nodes, up to the budget
        features: Sequence[object] | None = None,  # per sequence, proposer-specific target outputs
    ) -> list[Proposal]:  # (EAGLE: target hidden states of the tokens verified last step)
        ...

    def attach(self, engine: object) -> None:
        """Called once, before the first step, with the engine (proposers that size a cache from it)."""

    def max_tokens_for(self, seq: SequenceView) -> int | None:
        """A cap on this request's K (0: decode it plainly), or None for no cap (most proposers)."""
        return None

    def tree_budgets(self) -> tuple[TreeBudget, ...]:
        """Every cost model this proposer's trees are sized by (the strategy probes the verify costs into each)."""
        return () if self.tree_budget is None else (self.tree_budget,)

    def tree_budget_for(self, request_id: str) -> TreeBudget | None:
        """The cost model that sizes this request's trees, fed with its verified rounds and its step share."""
        return self.tree_budget

    def rounds_by_draft(self) -> dict[tuple[str, str], int]:
        """(domain, method) -> proposals made, for proposers that hold several drafts (else empty)."""
        return {}

    def on_accepted(self, request_id: str, result: VerifyResult) -> None:
        """Verification outcome of the last proposal: keep state for result.accepted_node_ids only."""

    def reset(self, request_id: str) -> None:
        """Forget the request (finished, aborted or preempted)."""

    def fork(self, parent_id: str, child_id: str) -> None:
        """A sample forked from `parent_id` (parallel sampling, right after the parent's first token) continues
        from the parent's state: copy what is kept per request. Proposers that rebuild their state from the
        sequence's tokens (standalone, n-gram) keep nothing to copy."""

    def add_features(self, request_id: str, features: TargetFeatures) -> None:
        """Target features of the positions the target just computed and kept (needs_hidden only).

        Called after every forward + verify, after on_accepted, before the sequence's next propose.
        Consecutive calls cover consecutive positions; after reset they start again at the first
        position the target computes (0, or the prefix-cache hit length)."""

    def add_feature_batch(self, batch: FeatureBatch) -> None:
        """A step's features of every sequence at once (what the strategy calls): by default one add_features
        per sequence; a proposer that keeps rows overrides it to check and move the batch once."""
        for request_id, features in batch.per_request():
            self.add_features(request_id, features)
