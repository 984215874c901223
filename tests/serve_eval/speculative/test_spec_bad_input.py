"""Bad speculative configurations fail early with a ValueError naming both sides: K <= 0, a draft
whose vocabulary (or hidden size) does not match the target, a feature draft made for another
target fingerprint, a tree shape (or a proposed tree) over the node budget, a tree for a
chain-only proposer, an unknown method, a missing draft dir."""
from __future__ import annotations

import pytest
import torch

from draftsmith.serve_eval.engine import EngineConfig, LLMEngine, SamplingParams
from draftsmith.serve_eval.speculative.config import SpecConfig
from draftsmith.serve_eval.speculative.proposers.base import Proposal, Proposer
from draftsmith.serve_eval.speculative.strategy import SpeculativeStrategy
from draftsmith.serve_eval.speculative.tree import DraftTree
from spec_helpers import feature_draft, make_llama, proposer_available

ENGINE = dict(block_size=4, max_model_len=64, num_gpu_blocks=64)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_bad")
    return {"target": make_llama(root / "target", seed=0), "other": make_llama(root / "other", seed=7),
            "small_vocab": make_llama(root / "small_vocab", vocab=64, hidden=32, layers=1),
            "wide": make_llama(root / "wide", hidden=96, layers=1), "root": root}


def engine(dirs, spec):
    return LLMEngine(EngineConfig(str(dirs["target"]), **ENGINE), speculative=spec)


@pytest.mark.parametrize("k", [0, -2])
def test_k_must_be_positive(k):
    """K <= 0 is refused naming num_speculative_tokens and the value."""
    with pytest.raises(ValueError, match=rf"num_speculative_tokens \(K\) must be an int > 0, got {k}"):
        SpecConfig("ngram", num_speculative_tokens=k)


def test_unknown_method_and_missing_draft_path():
    with pytest.raises(ValueError, match="method 'lookahead' is not one of"):
        SpecConfig("lookahead")
    with pytest.raises(ValueError, match="'standalone' needs draft_path"):
        SpecConfig("standalone")


def test_standalone_vocab_mismatch_names_both_sizes(dirs):
    """A standalone draft of vocab 64 for a target of vocab 128."""
    with pytest.raises(ValueError, match="vocab_size=64.*vocab_size=128"):
        engine(dirs, SpecConfig("standalone", draft_path=str(dirs["small_vocab"])))


def test_tree_shape_over_budget_names_both_counts():
    """A static 4 x 4 tree (20 nodes) with a node budget of 8."""
    with pytest.raises(ValueError, match="20 nodes.*max_draft_nodes\\) is 8"):
        SpecConfig("medusa", draft_path="x", tree="static", tree_branching=[4, 4], max_draft_nodes=8)


def test_tree_for_chain_only_proposer(dirs):
    with pytest.raises(ValueError, match="'ngram' does not support trees, but tree='static'"):
        engine(dirs, SpecConfig("ngram", tree="static", tree_branching=[2]))


class OversizedTree(Proposer):
    supports_tree = True

    def propose(self, seqs, num_tokens, features=None):
        tokens = torch.arange(5)
        return [Proposal(tokens, tree=DraftTree(tokens, [-1] * 5)) for _ in seqs]


def test_proposed_tree_over_budget_is_refused_at_request_time(dirs):
    """A proposer returning 5 nodes against a budget of 3: the step raises naming both."""
    spec = SpecConfig("ngram", tree="static", tree_branching=[3], max_draft_nodes=3)
    eng = LLMEngine(EngineConfig(str(dirs["target"]), **ENGINE), strategy=SpeculativeStrategy(spec, OversizedTree()))
    eng.add_request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=8))
    with pytest.raises(ValueError, match="5 nodes but the node budget \\(max_draft_nodes\\) is 3"):
        for _ in range(4):
            eng.step()


@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle3"])
def test_feature_draft_for_another_target(dirs, kind):
    """A Medusa / EAGLE / EAGLE-3 draft fingerprinted for another target is refused naming both fingerprints."""
    if not proposer_available(kind):
        pytest.skip(f"{kind} proposer not installed yet")
    draft = feature_draft(kind, dirs["other"], dirs["root"] / f"{kind}_other")
    with pytest.raises(ValueError, match="fingerprint .* but the target's fingerprint is"):
        engine(dirs, SpecConfig(kind, draft_path=str(draft)))


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_feature_draft_hidden_mismatch(dirs, kind):
    """A draft built for hidden 96 used on a hidden-64 target: both hidden sizes are named."""
    if not proposer_available(kind):
        pytest.skip(f"{kind} proposer not installed yet")
    draft = feature_draft(kind, dirs["wide"], dirs["root"] / f"{kind}_wide")
    with pytest.raises(ValueError, match="hidden_size=96.*hidden_size=64"):
        engine(dirs, SpecConfig(kind, draft_path=str(draft)))


def test_missing_draft_dir(dirs):
    with pytest.raises(ValueError, match="not a draft dir|missing"):
        engine(dirs, SpecConfig("standalone", draft_path=str(dirs["root"] / "nope")))


def test_unknown_draft_weight_storage_is_refused_naming_it():
    with pytest.raises(ValueError, match="draft_weight_storage must be one of .*got 'int3'"):
        SpecConfig("ngram", draft_weight_storage="int3")

