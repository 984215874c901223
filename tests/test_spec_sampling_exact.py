"""Sampling exactness of speculative decoding in the engine (vocab 16 target and draft).

The first generated token comes from the prefill; the next two (x2, x3) come from the first
speculative round: x2 is draft position 1 (accepted draft or residual sample), x3 position 2
(accepted draft, residual sample or bonus). For each configuration we compare the empirical
distributions of x2 and of x3 over N requests (one engine run, each request its own seed) with the
target's exact distributions, enumerated by teacher-forced forwards of the target over every
prefix (x1, x2): P(x2) = sum_x1 p(x1) p(x2|x1), P(x3) = sum_{x1,x2} p(x1) p(x2|x1) p(x3|x1,x2),
all through kernels.sampling.logits_to_probs with the request's temperature / top-p.

Configurations: chain (standalone draft, K = 2) and tree (two i.i.d. sampled children under the
root, each with one sampled child), at T = 1.0 and at T = 0.7 with top-p 0.8.

Test: G-test (likelihood ratio) per marginal, cells with expected count < 5 pooled, significance
alpha = 0.01 per test (8 tests; every request is seeded, so the outcome is deterministic: alpha is
the chance that a correct implementation fails for this fixed seed set). Power: any alternative at
total-variation distance 0.02 has chi-square divergence >= (2 * 0.02)^2 (Cauchy-Schwarz), so the
noncentrality is >= N * 0.0016 = 25.6 at N = 16000; with <= 15 degrees of freedom the noncentral
chi-square exceeds the 0.01 critical value with probability >= 0.80 (computed in the test from
scipy.stats.ncx2 with the pooled df actually used, and asserted >= 0.80).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from kernels.sampling import logits_to_probs, sample
from serve_eval.engine import EngineConfig, LLMEngine, SamplingParams
from serve_eval.spec.config import SpecConfig
from serve_eval.spec.proposers.base import Proposal, Proposer
from serve_eval.spec.strategy import SpeculativeStrategy
from serve_eval.spec.tree import DraftTree
from tests.spec_helpers import make_llama

V = 16
N = 16000
ALPHA = 1e-2
TV = 0.02
PROMPT = [3, 7, 1]
PARAMS = [(1.0, 1.0), (0.7, 0.8)]  # (temperature, top_p)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_sampling")
    # Larger init spreads the logits so the distributions are neither flat nor one-hot.
    return (make_llama(root / "target", vocab=V, hidden=16, layers=1, seed=0, init=0.2),
            make_llama(root / "draft", vocab=V, hidden=16, layers=1, seed=1, init=0.2))


def exact_marginals(target_dir, temperature, top_p):
    """P(x2), P(x3) by enumeration over (x1, x2) with teacher-forced forwards of the HF target."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(target_dir).eval()

    def next_probs(prefixes):  # [B, L] -> [B, V]
        with torch.no_grad():
            logits = model(torch.tensor(prefixes)).logits[:, -1].float()
        return logits_to_probs(logits, temperature, 0, top_p).double()

    p1 = next_probs([PROMPT])[0]
    p2_given = next_probs([PROMPT + [a] for a in range(V)])  # [x1, x2]
    p3_given = next_probs([PROMPT + [a, b] for a in range(V) for b in range(V)]).view(V, V, V)
    joint12 = p1[:, None] * p2_given
    return joint12.sum(0).numpy(), (joint12[:, :, None] * p3_given).sum((0, 1)).numpy()


class SampledTreeProposer(Proposer):
    """Two i.i.d. children of the root drawn from q1 = draft(root), each with one child drawn from
    q2 = draft(child); q comes from a fixed random logit table through logits_to_probs with the
    request's params, and every draw uses the request's generator (exact per SpecInfer)."""

    supports_tree = True

    def __init__(self):
        self.table = torch.randn(V, V, generator=torch.Generator().manual_seed(9)) * 1.5

    def _q(self, seqs, last):  # [B] tokens -> [B, V]
        p = [s.params for s in seqs]
        return logits_to_probs(self.table[last], [x.temperature for x in p], [x.top_k for x in p],
                               [x.top_p for x in p])

    def propose(self, seqs, num_tokens, features=None):
        gens = [s.generator for s in seqs]
        root = torch.tensor([s.token_ids[-1] for s in seqs])
        q1 = self._q(seqs, root)
        a, b = sample(q1, gens), sample(q1, gens)
        qa, qb = self._q(seqs, a), self._q(seqs, b)
        a2, b2 = sample(qa, gens), sample(qb, gens)
        out = []
        for i in range(len(seqs)):
            tokens = torch.stack([a[i], b[i], a2[i], b2[i]])
            probs = torch.stack([q1[i], q1[i], qa[i], qb[i]])
            out.append(Proposal(tokens, tree=DraftTree(tokens, [-1, -1, 0, 1], draft_probs=probs)))
        return out


def g_test(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int, float]:
    """(p-value, df, power vs TV 0.02) with cells of expected count < 5 pooled into one."""
    expected = probs * counts.sum()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    assert obs.sum() == counts.sum(), "samples fell outside the target's support"
    nonzero = obs > 0
    g = 2 * float((obs[nonzero] * np.log(obs[nonzero] / exp[nonzero])).sum())
    df = len(obs) - 1
    critical = stats.chi2.ppf(1 - ALPHA, df)
    power = float(stats.ncx2.sf(critical, df, counts.sum() * (2 * TV) ** 2))
    return float(stats.chi2.sf(g, df)), df, power


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_first_speculative_tokens_follow_the_target(models, mode):
    """x2 and x3 (first speculative round) are distributed as the target's, chain and tree, T 1.0 and
    0.7 with top-p 0.8 (G-test, alpha 0.01, power >= 0.80 vs TV 0.02: see the module docstring)."""
    target_dir, draft_dir = models
    cfg = EngineConfig(str(target_dir), block_size=4, max_model_len=16, num_gpu_blocks=4 * len(PARAMS) * N + 64,
                       max_num_seqs=len(PARAMS) * N, max_num_batched_tokens=40 * len(PARAMS) * N,
                       enable_prefix_caching=False)
    if mode == "chain":
        engine = LLMEngine(cfg, speculative=SpecConfig("standalone", draft_path=str(draft_dir), num_speculative_tokens=2))
    else:
        spec = SpecConfig("ngram", num_speculative_tokens=2, tree="static", tree_branching=[2, 1], max_draft_nodes=4)
        engine = LLMEngine(cfg, strategy=SpeculativeStrategy(spec, SampledTreeProposer()))
    for j, (temperature, top_p) in enumerate(PARAMS):
        for i in range(N):
            engine.add_request(f"{j}-{i}", PROMPT, SamplingParams(temperature=temperature, top_p=top_p,
                                                                  max_tokens=3, seed=j * N + i, ignore_eos=True))
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.output_token_ids
    total = engine.stats().spec["total"]
    assert total["rounds"] >= len(PARAMS) * N and 0 < total["accepted"] < total["proposed"]
    for j, (temperature, top_p) in enumerate(PARAMS):
        tokens = np.array([outs[f"{j}-{i}"] for i in range(N)])
        exact2, exact3 = exact_marginals(target_dir, temperature, top_p)
        for position, exact in ((1, exact2), (2, exact3)):
            counts = np.bincount(tokens[:, position], minlength=V)
            p_value, df, power = g_test(counts, exact)
            assert power >= 0.80, f"design: power {power:.3f} with df {df}"
            assert p_value > ALPHA, (f"{mode} T={temperature} top_p={top_p} x{position + 1}: p={p_value:.2e} "
                                     f"(df {df}); counts {counts.tolist()} vs expected {(exact * N).round(1).tolist()}")
