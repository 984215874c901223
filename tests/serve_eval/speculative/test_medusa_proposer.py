"""Medusa proposer: chains equal the heads applied directly, state follows the fed features, static trees
are the heads' top-k within the node budget, and a draft for another target fails at construction."""

from __future__ import annotations


import pytest
import torch
from torch import nn

from draftsmith.kernels.layers.checkpoint import load_target_embed_and_head
from draftsmith.drafts.identity import target_fingerprint
from draftsmith.drafts.io import save_draft
from draftsmith.drafts.medusa import MedusaDraft
from draftsmith.kernels.sampling import logits_to_probs, sample
from draftsmith.serve_eval.engine.model_executor import ModelExecutor
from draftsmith.serve_eval.speculative.config import SpecConfig
from draftsmith.serve_eval.speculative.proposers.base import TargetFeatures
from draftsmith.serve_eval.speculative.proposers.medusa import MedusaProposer
from draftsmith.serve_eval.speculative.tree import TreeShape
from spec_helpers import Seq, params
from tiny_models import save_tiny_model

VOCAB, HIDDEN, HEADS = 80, 32, 4


TARGET = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, max_position_embeddings=128)


@pytest.fixture(scope="module")
def target_dir(family_checkpoint):
    return family_checkpoint("llama", **TARGET)


def make_draft(target_dir, shared=True):
    torch.manual_seed(1)
    draft = MedusaDraft.from_target_config(target_dir, num_heads=HEADS, shared_lm_head=shared)
    for p in draft.parameters():  # heads that differ from the target's (zero-initialised) identity
        nn.init.normal_(p, std=0.3)
    _, head = load_target_embed_and_head(target_dir)
    draft.init_from_target(head * 20)
    return draft.eval()




@torch.inference_mode()
def test_chain_equals_heads_applied_directly(target_dir):
    """Greedy: head k's argmax on the last fed hidden (point masses). Sampled (top-k/top-p): rows equal
    logits_to_probs of the head logits and tokens equal draws from those rows with the same seeded generator.
    K above the number of heads is capped at the heads."""
    draft = make_draft(target_dir)
    proposer = MedusaProposer.from_draft(draft)
    hidden = torch.randn(12, HIDDEN, generator=torch.Generator().manual_seed(3))
    proposer.add_features("g", TargetFeatures(0, hidden[:7]))
    proposer.add_features("s", TargetFeatures(0, hidden[:10]))
    seqs = [Seq("g", list(range(8)), params()), Seq("s", list(range(11)), params(0.7, 30, 0.9),
                                                     torch.Generator().manual_seed(5))]
    greedy, sampled = proposer.propose(seqs, [6, 3])
    logits = draft(hidden[6])  # [heads, V]
    assert greedy.tokens.tolist() == logits.argmax(-1).tolist() and greedy.draft_probs is None
    rows = logits_to_probs(draft(hidden[9])[:3].float(), 0.7, 30, 0.9)
    torch.testing.assert_close(sampled.draft_probs, rows)
    gen = torch.Generator().manual_seed(5)
    assert sampled.tokens.tolist() == sample(rows, [gen] * 3).tolist()


@torch.inference_mode()
def test_state_follows_fed_features(target_dir):
    """Fed in chunks or at once, the proposal is the same; a sequence whose features lag its tokens (or that
    was reset) gets an empty proposal (a plain sampling step); a gap in positions is a clear error."""
    proposer = MedusaProposer.from_draft(make_draft(target_dir, shared=False))
    hidden = torch.randn(20, HIDDEN, generator=torch.Generator().manual_seed(4))
    for start, end in [(0, 5), (5, 6), (6, 9)]:
        proposer.add_features("a", TargetFeatures(start, hidden[start:end]))
    proposer.add_features("b", TargetFeatures(0, hidden[:9]))
    a, b, lagging = proposer.propose([Seq("a", list(range(10)), params()), Seq("b", list(range(10)), params()),
                                      Seq("a", list(range(11)), params())], [4, 4, 4])
    assert a.tokens.tolist() == b.tokens.tolist() and a.num_tokens == 4
    assert lagging.num_tokens == 0
    with pytest.raises(ValueError, match="start_pos is 10 but the proposer expects the next position 9"):
        proposer.add_features("a", TargetFeatures(10, hidden[10:11]))
    proposer.reset("a")
    assert proposer.propose([Seq("a", list(range(10)), params())], [2])[0].num_tokens == 0


@torch.inference_mode()
def test_static_tree_is_heads_topk(target_dir):
    """A static tree's node at depth d and rank c carries head d-1's c-th best token, every node a point mass,
    parents as the shape says; shapes deeper than the heads or over the node budget are refused."""
    draft = make_draft(target_dir)
    shape = TreeShape.from_paths([(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 1)], max_nodes=8)
    proposer = MedusaProposer.from_draft(draft, shape)
    hidden = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(6))
    proposer.add_features("t", TargetFeatures(0, hidden))
    (proposal,) = proposer.propose([Seq("t", list(range(5)), params(1.0))], [4])
    tree = proposal.tree
    top = draft(hidden[-1]).topk(3, dim=-1).indices  # [heads, 3]
    expected = [int(top[len(path) - 1, path[-1]]) for path in shape.paths]
    assert tree.tokens.tolist() == expected and tree.parents.tolist() == list(shape.parents)
    assert proposal.draft_probs is None and tree.draft_probs is None
    assert tree.num_nodes <= 8
    deep = TreeShape.from_branching([1] * (HEADS + 1))
    with pytest.raises(ValueError, match=f"depth {HEADS + 1} but the draft has only {HEADS} heads"):
        MedusaProposer.from_draft(draft, deep)
    with pytest.raises(ValueError, match="has 12 nodes but the node budget"):
        SpecConfig(method="medusa", draft_path="x", tree="static", tree_branching=[3, 3], max_draft_nodes=10)


def test_constructor_checks_target(target_dir, tmp_path):
    """Built like the registry builds it: a matching draft loads (with its static tree); a draft saved for
    another target's fingerprint, or for another vocabulary / hidden size, fails naming both sides."""
    executor = ModelExecutor(target_dir)
    fp = target_fingerprint(target_dir)
    good = save_draft(make_draft(target_dir), tmp_path / "good", target_fingerprint=fp)
    cfg = SpecConfig(method="medusa", draft_path=str(good), tree="static", tree_branching=[2, 2], max_draft_nodes=6)
    proposer = MedusaProposer(cfg, executor, "cpu", torch.float32, target_dir)
    assert proposer.tree_shape.num_nodes == 6 and proposer.needs_hidden and proposer.aux_layers == ()
    foreign = save_draft(make_draft(target_dir), tmp_path / "foreign", target_fingerprint="fedcba9876543210")
    with pytest.raises(ValueError, match=f"fingerprint fedcba9876543210, but the target's fingerprint is {fp}"):
        MedusaProposer(SpecConfig(method="medusa", draft_path=str(foreign)), executor, "cpu", torch.float32, target_dir)
    other = save_tiny_model(tmp_path / "other", **{**TARGET, "hidden_size": 48})
    wrong = save_draft(MedusaDraft.from_target_config(other), tmp_path / "wrong")
    with pytest.raises(ValueError, match="hidden_size=48, but the target has hidden_size=32"):
        MedusaProposer(SpecConfig(method="medusa", draft_path=str(wrong)), executor, "cpu", torch.float32)
    with pytest.raises(ValueError, match="tree='static'"):
        MedusaProposer(SpecConfig(method="medusa", draft_path=str(good), tree="dynamic"), executor)
