"""Medusa proposer: one pass of the draft's heads over the target's last fed hidden state.

Head k (0-based) reads the target's final-norm hidden at position t and predicts the token at t + k + 2.
When the engine next proposes for a sequence of length L, the last emitted token (the root) sits at L - 1
and the last fed hidden is at t = L - 2, so head k predicts draft token k (position L + k).

* chain: K = min(K, num_heads) tokens; T = 0 -> each head's argmax (point masses, draft_probs None);
  T > 0 -> each token sampled from its head's `logits_to_probs` row with the request's generator
  (draft_probs = those rows). Heads do not condition on each other's picks, which rejection sampling
  allows: each row is still the exact distribution its token was drawn from.
* tree: a static Medusa tree (TreeShape); depth d's rank-c node is head d-1's c-th best token, a point mass.

The helpers it shares with the other feature proposers are in serve_eval.speculative.proposers.features.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from draftsmith.kernels.sampling import logits_to_probs
from draftsmith.serve_eval.speculative.proposers.base import (
    Proposal,
    Proposer,
    SequenceView,
    TargetFeatures,
    check_num_tokens,
    empty_proposal,
    sampling_arrays,
)
from draftsmith.serve_eval.speculative.proposers.features import (
    check_features,
    draw_rows,
    engine_build_args,
    feed_features,
    load_feature_draft,
    serving_form,
)
from draftsmith.serve_eval.speculative.proposers.registry import register_proposer
from draftsmith.serve_eval.speculative.tree import TreeShape
from draftsmith.serve_eval.speculative.verify import VerifyResult

@register_proposer("medusa")
class MedusaProposer(Proposer):
    needs_hidden = True
    aux_layers: tuple[int, ...] = ()
    supports_tree = True
    tree_modes = ("static",)

    def __init__(self, spec_config: Any, target_executor: Any, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, target_model_dir: str | Path | None = None) -> None:
        mode = getattr(spec_config, "tree", "none")
        if mode not in ("none", "static"):
            raise ValueError(f"Medusa proposes chains or static trees (tree='static'), got tree={mode!r}")
        loaded = load_feature_draft(spec_config, target_executor, device, dtype, ("medusa",), target_model_dir)
        self._setup(serving_form(loaded.model, copy_first=False), spec_config.tree_shape() if mode == "static" else None)

    @classmethod
    def from_spec_config(cls, spec_config: Any, engine: Any) -> "MedusaProposer":
        """The registry's constructor (serve_eval.speculative.config): the engine's target, device and dtype."""
        return cls(*engine_build_args(spec_config, engine))

    @classmethod
    def from_draft(cls, draft: torch.nn.Module, tree_shape: TreeShape | None = None) -> "MedusaProposer":
        """Wrap an in-memory MedusaDraft (no target checks; tests and notebooks)."""
        proposer = cls.__new__(cls)
        proposer._setup(serving_form(draft), tree_shape)
        return proposer

    def _setup(self, draft: torch.nn.Module, tree_shape: TreeShape | None) -> None:
        self.draft = draft
        self.num_heads: int = draft.config.num_heads
        self.hidden_size: int = draft.config.hidden_size
        if tree_shape is not None and tree_shape.max_depth > self.num_heads:
            raise ValueError(
                f"Medusa tree shape has depth {tree_shape.max_depth} but the draft has only {self.num_heads} heads"
            )
        self.tree_shape = tree_shape
        # request id -> (position of the last fed hidden, that hidden [d])
        self._last: dict[str, tuple[int, Tensor]] = {}

    # -- features --------------------------------------------------------------------
    def add_features(self, request_id: str, feats: TargetFeatures) -> None:
        last = self._last.get(request_id)
        check_features(feats, None if last is None else last[0] + 1, request_id, self.hidden_size, "hidden")
        if feats.hidden.shape[0]:
            self._last[request_id] = (feats.start_pos + feats.hidden.shape[0] - 1, feats.hidden[-1])

    def on_accepted(self, request_id: str, result: VerifyResult) -> None:
        """Stateless heads: the accepted rows arrive through add_features."""

    def reset(self, request_id: str) -> None:
        self._last.pop(request_id, None)

    def fork(self, parent_id: str, child_id: str) -> None:
        if parent_id in self._last:
            self._last[child_id] = self._last[parent_id]

    # -- proposing -------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, seqs: Sequence[SequenceView], num_tokens: Sequence[int],
                features: Sequence[object] | None = None) -> list[Proposal]:
        check_num_tokens(num_tokens, len(seqs))
        feed_features(self, seqs, features)
        weight = next(self.draft.parameters())
        out = [empty_proposal(weight.device) for _ in seqs]
        # Only sequences whose last fed hidden sits right before the root can be drafted for.
        ready = [b for b, s in enumerate(seqs)
                 if s.request_id in self._last and self._last[s.request_id][0] == len(s.token_ids) - 2]
        if not ready:
            return out
        hidden = torch.stack([self._last[seqs[b].request_id][1] for b in ready]).to(weight.device, weight.dtype)
        logits = self.draft(hidden).float()  # [B, heads, V]
        if self.tree_shape is not None:
            depth, width = self.tree_shape.max_depth, self.tree_shape.max_rank
            topk = logits[:, :depth].topk(width, dim=-1).indices  # [B, depth, width]
            for i, b in enumerate(ready):
                tree = self.tree_shape.fill_medusa(topk[i])
                out[b] = Proposal(tree.tokens, None, tree)
            return out
        return self._chains(seqs, num_tokens, ready, logits, out)

    def _chains(self, seqs, num_tokens, ready: list[int], logits: Tensor, out: list[Proposal]) -> list[Proposal]:
        counts = [min(num_tokens[b], self.num_heads) for b in ready]
        rows = torch.cat([logits[i, :k] for i, k in enumerate(counts)])  # [sum k, V]
        temperature, top_k, top_p = sampling_arrays([seqs[b] for b in ready], rows.device)
        repeat = torch.tensor(counts, device=rows.device)
        probs = logits_to_probs(rows, temperature.repeat_interleave(repeat), top_k.repeat_interleave(repeat),
                                top_p.repeat_interleave(repeat))
        greedy = [seqs[b].params.temperature == 0 for b, k in zip(ready, counts) for _ in range(k)]
        generators = [seqs[b].generator for b, k in zip(ready, counts) for _ in range(k)]
        tokens = draw_rows(probs, generators, greedy)
        start = 0
        for b, k in zip(ready, counts):
            point_mass = seqs[b].params.temperature == 0
            out[b] = Proposal(tokens[start:start + k], None if point_mass else probs[start:start + k])
            start += k
        return out

