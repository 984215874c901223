"""Speculative metrics measured by the engine: a scripted proposer with known acceptances per round
gives hand-computed alpha, tau and a_k per request, per domain and in total (engine.stats().spec and
RequestOutput.spec); tree rounds count positions by depth; the policy's fallback switches a domain
whose drafts are always rejected off, and probes it again later."""
from __future__ import annotations

import math

import pytest
import torch

from draftsmith.serve_eval.engine import EngineConfig, LLMEngine, SamplingParams
from draftsmith.serve_eval.speculative.config import SpecConfig
from draftsmith.serve_eval.speculative.policy import SpecPolicyConfig
from draftsmith.serve_eval.speculative.proposers.base import Proposal, Proposer
from draftsmith.serve_eval.speculative.strategy import SpeculativeStrategy
from draftsmith.serve_eval.speculative.tree import DraftTree
from spec_helpers import VOCAB, greedy_reference, make_llama, run_engine

ENGINE = dict(block_size=4, max_model_len=120, num_gpu_blocks=200)
K = 3


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_llama(tmp_path_factory.mktemp("spec_metrics") / "target", layers=2, seed=0)


class ScriptedProposer(Proposer):
    """Round r of request q proposes K tokens of which exactly script[q][r] lead the greedy path
    (the next one is wrong); after the script, empty proposals (no rounds)."""

    supports_tree = True

    def __init__(self, full, script, tree=False):
        self.full, self.script, self.tree = full, script, tree
        self.round = {rid: 0 for rid in script}

    def propose(self, seqs, num_tokens, features=None):
        out = []
        for seq, k in zip(seqs, num_tokens):
            r = self.round[seq.request_id]
            if r >= len(self.script[seq.request_id]):
                out.append(Proposal(torch.zeros(0, dtype=torch.int64)))
                continue
            self.round[seq.request_id] += 1
            good = self.script[seq.request_id][r]
            pos = len(seq.token_ids)
            truth = self.full[seq.request_id][pos:pos + k]
            toks = [t if d < good else (t + 1) % VOCAB for d, t in enumerate(truth)]
            if not self.tree:
                out.append(Proposal(torch.tensor(toks)))
                continue
            # Chain of K plus one wrong sibling under the root: K + 1 nodes, depth K.
            nodes = [(toks[0] + 2) % VOCAB] + toks
            parents = [-1, -1] + list(range(1, k))
            out.append(Proposal(torch.tensor(nodes), tree=DraftTree(torch.tensor(nodes), parents)))
        return out


def expected(rounds, nodes_per_round):
    proposed = nodes_per_round * len(rounds)
    accepted = sum(rounds)
    a_k = [sum(a >= k for a in rounds) / len(rounds) for k in range(1, K + 1)]
    return accepted / proposed, 1 + accepted / len(rounds), a_k


@pytest.mark.parametrize("tree", [False, True])
def test_hand_computed_alpha_tau_ak(target, tree):
    """alpha = accepted / proposed, tau = 1 + accepted / rounds, a_k = rounds accepting k / rounds
    reaching k; per request, per domain, total; a tree of K + 1 nodes and depth K counts K positions."""
    prompts = [[3, 9, 27, 81, 5], [7, 11, 13]]
    script = {"r0": [3, 0, 1, 2, 3, 1], "r1": [0, 2, 2, 3]}
    # Enough tokens that the K clamp near max_tokens never bites during the script.
    lengths = [1 + sum(a + 1 for a in script[r]) + K + 2 for r in ("r0", "r1")]
    ref = greedy_reference(target, prompts, lengths, **ENGINE)
    full = {f"r{i}": prompts[i] + ref[f"r{i}"] for i in range(2)}
    spec = SpecConfig("ngram", num_speculative_tokens=K,
                      **({"tree": "static", "tree_branching": [2], "max_draft_nodes": K + 1} if tree else {}))
    engine = LLMEngine(EngineConfig(str(target), **ENGINE),
                       strategy=SpeculativeStrategy(spec, ScriptedProposer(full, script, tree)))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    outs = run_engine(engine, prompts, params, domains=["code", "chat"])
    nodes = K + 1 if tree else K
    stats = engine.stats().spec
    for rid, domain in (("r0", "code"), ("r1", "chat")):
        assert outs[rid].output_token_ids == ref[rid]
        alpha, tau, a_k = expected(script[rid], nodes)
        for got in (outs[rid].spec.to_dict(), stats.by_domain[domain].to_dict()):
            assert got["rounds"] == len(script[rid])
            assert got["proposed"] == nodes * len(script[rid])
            assert math.isclose(got["alpha"], alpha) and math.isclose(got["tau"], tau)
            assert got["acceptance_by_position"] == pytest.approx(a_k)
    both = script["r0"] + script["r1"]
    alpha, tau, a_k = expected(both, nodes)
    total = stats.total.to_dict()
    assert math.isclose(total["alpha"], alpha) and math.isclose(total["tau"], tau)
    assert total["acceptance_by_position"] == pytest.approx(a_k)
    assert total["draft_time_s"] > 0 and total["target_time_s"] > 0
    assert math.isclose(total["draft_time_s"], engine.strategy.draft_time_s, rel_tol=1e-9)


class AlwaysWrong(Proposer):
    def __init__(self):
        self.calls = 0

    def propose(self, seqs, num_tokens, features=None):
        self.calls += 1
        # last token + 1, repeated: the greedy target rarely continues that way (alpha stays far below 0.5)
        return [Proposal(torch.full((k,), (s.token_ids[-1] + 1) % VOCAB)) for s, k in zip(seqs, num_tokens)]


def test_fallback_switches_a_bad_domain_off_and_probes_again(target):
    """With alpha ~ 0, speculation stops after min_rounds rounds (no lookahead, no proposer calls),
    and resumes for a probe after probe_after_steps plain decode steps; output is unchanged."""
    policy = SpecPolicyConfig(min_rounds=4, window_rounds=4, probe_after_steps=6, min_alpha=0.5)
    proposer = AlwaysWrong()
    spec = SpecConfig("ngram", num_speculative_tokens=2, policy=policy)
    engine = LLMEngine(EngineConfig(str(target), **ENGINE), strategy=SpeculativeStrategy(spec, proposer))
    ref = greedy_reference(target, [[1, 2, 3]], [40], **ENGINE)
    seen = []

    def check(eng):
        seen.append((proposer.calls, eng.strategy.policy.is_enabled("math")))

    outs = run_engine(engine, [[1, 2, 3]], [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)],
                      domains=["math"], check=check)
    assert outs["r0"].output_token_ids == ref["r0"]
    enabled = [e for _, e in seen]
    first_off = enabled.index(False)
    assert seen[first_off][0] == 4, "switched off right after min_rounds rounds"
    back_on = enabled.index(True, first_off)
    assert back_on - first_off == 6, "probe after probe_after_steps plain steps"
    calls_while_off = {c for c, e in seen[first_off:back_on]}
    assert calls_while_off == {4}, "no proposals while the domain is off"
    assert engine.stats().spec.policy["math"]["probe_wait"] >= 6


def test_probe_wait_counts_engine_steps_not_sequences(target):
    """Three sequences of one domain decode together: the probe still waits probe_after_steps engine
    steps (counted per sequence it would come after 6 / 3 = 2)."""
    policy = SpecPolicyConfig(min_rounds=4, window_rounds=4, probe_after_steps=6, min_alpha=0.5)
    spec = SpecConfig("ngram", num_speculative_tokens=2, policy=policy)
    engine = LLMEngine(EngineConfig(str(target), **ENGINE), strategy=SpeculativeStrategy(spec, AlwaysWrong()))
    enabled = []
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)] * 3
    run_engine(engine, [[1, 2, 3], [4, 5, 6], [7, 8, 9]], params, domains=["math"] * 3,
               check=lambda eng: enabled.append(eng.strategy.policy.is_enabled("math")))
    first_off = enabled.index(False)
    assert enabled.index(True, first_off) - first_off == 6
