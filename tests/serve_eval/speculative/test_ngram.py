"""draftsmith.serve_eval.speculative.proposers.ngram: prompt lookup, plus the Proposal / Proposer protocol basics."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from draftsmith.kernels.sampling import logits_to_probs
from draftsmith.serve_eval.speculative.proposers.base import Proposal, Proposer, empty_proposal, sampling_arrays
from draftsmith.serve_eval.speculative.proposers.ngram import NgramProposer, lookup_continuation
from draftsmith.serve_eval.speculative.tree import DraftTree
from draftsmith.serve_eval.speculative.verify import verify_chain


@dataclass
class Params:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0


@dataclass
class Seq:
    token_ids: list[int]
    request_id: str = "r"
    params: Params = field(default_factory=Params)
    generator: torch.Generator | None = None


def propose(tokens, k=3, **kwargs) -> list[int]:
    return NgramProposer(**kwargs).propose([Seq(tokens)], [k])[0].tokens.tolist()


def test_copies_tokens_after_earlier_occurrence():
    """The last tokens [1, 2] occurred at the start; the draft is what followed them."""
    assert propose([1, 2, 3, 4, 1, 2], k=2, max_n=2) == [3, 4]


def test_longest_ngram_wins_over_more_recent_shorter_match():
    """n is tried from max to min: the bigram match beats a more recent unigram match."""
    tokens = [5, 1, 2, 9, 7, 2, 8, 1, 2]
    assert propose(tokens, k=2, max_n=2) == [9, 7]
    assert propose(tokens, k=2, max_n=1) == [8, 1]  # unigram "2": most recent full match at index 5


def test_prefers_recent_full_match_else_longest_continuation():
    """Most recent match with K following tokens; if none is full, the earliest (longest) one."""
    assert propose([3, 9, 9, 3, 8, 8, 3], k=2, max_n=1) == [8, 8]
    assert propose([3, 7, 3, 5, 3], k=3, max_n=1) == [7, 3, 5]
    assert propose([4, 6, 4], k=3, max_n=1) == [6, 4]  # only 2 tokens follow the match


def test_no_match_gives_empty_proposal():
    """Nothing to copy -> K = 0 proposal, which verifies as a plain decode step."""
    proposal = NgramProposer().propose([Seq([1, 2, 3])], [4])[0]
    assert proposal.num_tokens == 0 and proposal.draft_probs is None and proposal.tree is None
    target = torch.softmax(torch.randn(1, 5), -1)
    assert verify_chain(proposal.tokens, None, target, greedy=True).accepted_tokens == [int(target.argmax())]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.integers(1, 6), st.integers(1, 4))
def test_every_draft_follows_a_real_occurrence(tokens, k, max_n):
    """Property: a non-empty draft equals the tokens after an earlier occurrence of some suffix n-gram."""
    history = np.array(tokens)
    draft = lookup_continuation(history, k, max_n, 1).tolist()
    assert len(draft) <= k
    if not draft:
        assert not (history[:-1] == history[-1]).any()  # no unigram match at all
        return
    found = False
    for n in range(1, min(max_n, len(tokens) - 1) + 1):
        for start in range(len(tokens) - n):
            if tokens[start : start + n] == tokens[-n:] and tokens[start + n : start + n + k] == draft:
                found = True
    assert found


def test_bad_input():
    """K <= 0, inconsistent n-gram sizes and mismatched proposal shapes raise ValueError naming the values."""
    with pytest.raises(ValueError, match=r"K\) must be > 0, got 0"):
        NgramProposer().propose([Seq([1, 2])], [0])
    with pytest.raises(ValueError, match="got 2 num_tokens for 1 sequences"):
        NgramProposer().propose([Seq([1, 2])], [1, 2])
    with pytest.raises(ValueError, match="min_n 3, max_n 2"):
        NgramProposer(max_n=2, min_n=3)
    with pytest.raises(ValueError, match=r"draft_probs shape \(2, 5\) does not match 3 tokens x vocab 5"):
        Proposal(torch.tensor([1, 2, 3]), torch.rand(2, 5)).validate()
    with pytest.raises(ValueError, match="differ from its tree"):
        Proposal(torch.tensor([1, 2]), tree=DraftTree.chain([1, 3])).validate()


def test_protocol_and_helpers():
    """NgramProposer satisfies the Proposer protocol (hooks are no-ops); sampling_arrays feeds logits_to_probs."""
    proposer = NgramProposer()
    assert isinstance(proposer, Proposer)
    proposer.on_accepted("r", verify_chain([], None, torch.ones(1, 3) / 3, True))
    proposer.reset("r")
    assert empty_proposal().num_tokens == 0
    seqs = [Seq([1], params=Params(0.0)), Seq([1], params=Params(0.7, 2, 0.9))]
    temperature, top_k, top_p = sampling_arrays(seqs)
    probs = logits_to_probs(torch.randn(2, 6), temperature, top_k, top_p)
    assert probs[0].max() == 1.0 and (probs[1] > 0).sum() <= 2
