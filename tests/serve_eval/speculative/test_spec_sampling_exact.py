"""Sampling exactness of speculative decoding through the real engine (strategy + verify), vocab 8.

Tokens tested: the JOINT law of the 2nd and 3rd generated tokens (x2, x3). The 1st token x1 comes
from the prefill step and is never speculated (a plain sample of p(. | prompt)). The first speculative
round runs from root x1 with K = 2 (max_tokens = 4, so the strategy's clamp K <= max_tokens - outputs
- 1 still leaves K = 2; trees have depth 2). x2 is that round's first emitted token: the accepted
depth-1 draft or the residual sample after rejecting every depth-1 candidate. x3 is its second: the
accepted depth-2 draft, the residual sample at depth 2, or the bonus token; or, when x2 was a
correction, the first token of the next round. So the pair covers acceptance, rejection with residual
resampling at both depths, sibling rejection (trees) and the bonus token. Its law must be the target's:
    P(x2, x3) = sum_x1 p(x1 | prompt) p(x2 | prompt, x1) p(x3 | prompt, x1, x2),
enumerated exactly by teacher-forced forwards of the HF target over all V^2 prefixes (x1, x2), through
kernels.sampling.logits_to_probs with the request's temperature / top-p: V^2 = 64 cells.

Configurations, one engine run per proposer, every request with its own seed:
- chain: the standalone proposer (a noisy copy of the target; drafts SAMPLED from its rows);
- tree: the Medusa proposer with a static [3, 2] tree (9 nodes, point masses: three candidates at
  depth 1, two below each);
- block: the block-parallel proposer (an untrained block draft with the target's embedding and head; both
  drafts come from one forward, each SAMPLED from its own offset's row);
each at T = 1.0 and T = 0.7, both with top-p 0.8, with the policy's fallback off (every round
speculates);
- loop: the standalone proposer at a plain T = 1.0 (no top-k / top-p) on one thread, over a target and noisy
  copy whose heads are 8 wide, so the draft's second token comes from the C draft loop
  (kernels.layers.native_draft_loop: the row and the draw in C), the chains are verified in C and x1 is drawn
  by the C sampler (kernels.native_sampling); the test checks the loop and the C verifier served the rounds. Both drafts accept often but not always (measured fractions of rounds accepting >= 1 /
2 drafts: chain 0.40 / 0.29, tree 0.68 / 0.32), so every path above is taken thousands of times.

Test: Pearson chi-square (tests/stats_helpers.py: zero-probability cells must get no samples, cells of
expected count < 5 are pooled) at significance ALPHA = 0.001. Power against ANY joint at total
variation 0.02 from the target (worst case, noncentrality >= 4 N 0.02^2), computed from the exact joint
and the df actually used, asserted >= 0.9: N = 24,000 at T = 1.0 (top-p leaves 12 of the 64 cells
possible; df 11, power 0.93) and N = 22,000 at T = 0.7 (10 cells, df 9, power 0.91). Every request is
seeded, so for a fixed implementation the outcome is deterministic; alpha is the chance that a correct
implementation fails on this seed set.

min_tokens: a group of the chain run (T 1.0, top-p 0.8, 30,000 requests: df 16, power 0.93) has min_tokens = MAX_TOKENS and stop token
STOP, the target's likeliest first token; the engine masks STOP in every target row before verification, so its
(x2, x3) must follow the joint enumerated with STOP masked in every row (x1, x2 and x3 never STOP).

Negative controls proving the power: (1) the same samples tested against the target joint moved by TV
0.03 in the worst-case direction are rejected (power >= 0.999 there); (2) an engine-level exactness bug,
a chain proposer that draws its drafts from q but reports q^2 / sum(q^2) as their rows (a wrongly scaled
draft distribution; its output is ~0.06 TV off), is rejected by the same test on 4,000 requests.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from draftsmith.kernels.sampling import logits_to_probs
from draftsmith.serve_eval.engine import EngineConfig, LLMEngine, SamplingParams
from draftsmith.serve_eval.speculative.config import SpecConfig
from draftsmith.serve_eval.speculative.policy import SpecPolicyConfig
from spec_helpers import TEST_DEVICE, feature_draft, make_llama, noisy_copy
from stats_helpers import chi_square_fit, total_variation, worst_case_perturbation

V = 8
PROMPT = [3]  # one token: the prefill runs on the batched single-row attention path (fast)
K = 2
MAX_TOKENS = 4  # leaves K = 2 for the first round (the strategy clamps K to max_tokens - outputs - 1)
ALPHA = 1e-3
TV = 0.02
MIN_POWER = 0.9
CONTROL_TV = 0.03
# name -> (temperature, top_p, number of requests)
SETTINGS = {"T1.0-top_p0.8": (1.0, 0.8, 24_000), "T0.7-top_p0.8": (0.7, 0.8, 22_000)}
# The C draft loop's setting (mode "loop", its own target): a plain temperature, so every cell can occur
LOOP_SETTINGS = {"T1.0-plain": (1.0, 1.0, 40_000)}
TREE_BRANCHING = [3, 2]
TREE_NODES = 9
BAD = "bad-scaling"  # negative-control group, in the chain run
BAD_GROUP = (0.7, 0.8, 4_000)
BAD_POWER = 2.0  # reported draft rows q^BAD_POWER / sum(q^BAD_POWER); drafts still drawn from q
BLOCK_SIZE = 16  # prompt + outputs + lookahead fit one block per sequence
WAVE = 8_000  # requests in the engine at once
MIN_TOKENS = "T1.0-top_p0.8-min_tokens"  # chain-run group: min_tokens = MAX_TOKENS, STOP a stop token
MIN_TOKENS_GROUP = (1.0, 0.8, 30_000)
SETTINGS_OF_MIN_TOKENS = "T1.0-top_p0.8"  # the same temperature and top-p, unmasked
STOP = 0  # p(. | PROMPT) puts ~0.5 on it at T 1.0


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(target, standalone draft, Medusa draft) dirs. init 0.6 spreads the logits: x2 / x3 depend
    strongly on x1, and top-p 0.8 keeps 2-4 tokens per row, so the joint has few cells and N stays
    affordable. The draft seeds / noise were chosen for acceptance rates that exercise every path."""
    root = tmp_path_factory.mktemp("spec_sampling")
    target = make_llama(root / "target", vocab=V, hidden=16, layers=1, seed=0, init=0.6)
    draft = noisy_copy(target, root / "draft", noise=0.06, seed=3)
    medusa = feature_draft("medusa", target, root / "medusa", seed=7)
    from draftsmith.kernels.layers.checkpoint import load_target_embed_and_head

    block = feature_draft("block", target, root / "block", seed=5, block_opts={"block_size": K + 1},
                          init=lambda d: d.init_from_target(*load_target_embed_and_head(target)))
    # heads 8 wide: the native C layers and draft loop serve these two (the models above have 4-wide heads)
    loop_target = make_llama(root / "loop_target", vocab=V, hidden=16, layers=1, seed=1, init=0.6,
                             num_attention_heads=2, num_key_value_heads=2)
    loop_draft = noisy_copy(loop_target, root / "loop_draft", noise=0.06, seed=3)
    return target, draft, medusa, block, loop_target, loop_draft


def exact_pair_joint(target_dir, temperature: float, top_p: float, masked: int | None = None) -> np.ndarray:
    """P(x2, x3) [V, V] by enumeration over (x1, x2) with teacher-forced forwards of the HF target (`masked`: a
    token whose logit is -inf in every row, as min_tokens masks a stop token)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()

    def next_probs(prefixes: list[list[int]]) -> torch.Tensor:  # [B, L] -> [B, V]
        with torch.no_grad():
            logits = model(torch.tensor(prefixes)).logits[:, -1].float()
        if masked is not None:
            logits[:, masked] = float("-inf")
        # The engine computes these logits up to float rounding; a nucleus boundary that close to a
        # cumulative mass could be cut differently there and show up as an "impossible" sample.
        probs = torch.softmax(logits / temperature, dim=-1).sort(dim=-1, descending=True).values
        margin = float((probs.cumsum(-1) - probs - top_p).abs().min())
        assert top_p == 1 or margin > 1e-5, f"top-p {top_p} is within {margin:.1e} of a cumulative mass: pick another model"
        return logits_to_probs(logits, temperature, 0, top_p).double()

    p1 = next_probs([PROMPT])[0]  # [x1]
    p2 = next_probs([PROMPT + [a] for a in range(V)])  # [x1, x2]
    p3 = next_probs([PROMPT + [a, b] for a in range(V) for b in range(V)]).view(V, V, V)  # [x1, x2, x3]
    return (p1[:, None, None] * p2[:, :, None] * p3).sum(0).numpy()


def misreport_draft_rows(proposer, prefix: str, power: float) -> None:
    """Negative control: for requests whose id starts with prefix, the proposer still draws its drafts
    from q but reports normalize(q ** power) as the rows they were drawn from."""
    inner = proposer.propose

    def propose(seqs, num_tokens, features=None):
        proposals = inner(seqs, num_tokens, features)
        for b, (seq, proposal) in enumerate(zip(seqs, proposals)):
            if seq.request_id.startswith(prefix) and proposal.draft_probs is not None:
                wrong = proposal.draft_probs.double() ** power
                proposals[b] = proposal._replace(draft_probs=(wrong / wrong.sum(-1, keepdim=True)).float())
        return proposals

    proposer.propose = propose  # instance attribute: the strategy calls self.proposer.propose


def sample_pairs(engine: LLMEngine, groups: dict[str, tuple[float, float, int]]) -> dict[str, np.ndarray]:
    """(x2, x3) [n, 2] per group, each request from PROMPT with its own seed.

    Requests go in waves of WAVE (the scheduler's abort scans its queues, so huge queues would make
    aborting quadratic) and are aborted as soon as they hold 3 tokens: x4 is not needed."""
    requests = [(f"{name}/{i}", temperature, top_p) for name, (temperature, top_p, n) in groups.items()
                for i in range(n)]
    outputs: dict[str, list[int]] = {}
    for start in range(0, len(requests), WAVE):
        for seed, (request_id, temperature, top_p) in enumerate(requests[start:start + WAVE], start):
            stops = dict(min_tokens=MAX_TOKENS, stop_token_ids=[STOP]) if request_id.startswith(MIN_TOKENS + "/") else {}
            engine.add_request(request_id, PROMPT, SamplingParams(
                temperature=temperature, top_p=top_p, max_tokens=MAX_TOKENS, seed=seed, ignore_eos=True, **stops))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if len(out.output_token_ids) >= 3 and out.request_id not in outputs:
                    outputs[out.request_id] = out.output_token_ids[1:3]
                    if not out.finished:
                        engine.abort(out.request_id)
    return {name: np.array([outputs[f"{name}/{i}"] for i in range(n)]) for name, (_, _, n) in groups.items()}


def run_mode(models, mode: str) -> tuple[dict[str, np.ndarray], dict]:
    """One engine run over every setting's requests (chains: plus the negative-control group)."""
    target, draft, medusa, block, loop_target, loop_draft = models
    groups = dict(SETTINGS)
    policy = SpecPolicyConfig(fallback=False)  # every request speculates, whatever the running alpha
    threads: dict = {}
    if mode == "loop":   # one thread: the C kernels' condition
        target, groups, threads = loop_target, dict(LOOP_SETTINGS), {"num_threads": 1}
        spec = SpecConfig("standalone", draft_path=str(loop_draft), num_speculative_tokens=K, policy=policy)
    elif mode == "chain":
        spec = SpecConfig("standalone", draft_path=str(draft), num_speculative_tokens=K, policy=policy)
        groups[BAD] = BAD_GROUP
        groups[MIN_TOKENS] = MIN_TOKENS_GROUP
    elif mode == "block":  # one non-causal forward drafts both tokens, each from its own row
        spec = SpecConfig("block", draft_path=str(block), num_speculative_tokens=K, policy=policy)
    else:
        spec = SpecConfig("medusa", draft_path=str(medusa), num_speculative_tokens=K, tree="static",
                          tree_branching=TREE_BRANCHING, max_draft_nodes=TREE_NODES, policy=policy)
    cfg = EngineConfig(str(target), block_size=BLOCK_SIZE, max_model_len=BLOCK_SIZE, num_gpu_blocks=WAVE + 16,
                       num_cpu_blocks=16, max_num_seqs=WAVE, max_num_batched_tokens=16 * WAVE,
                       enable_prefix_caching=False, device=TEST_DEVICE, **threads)
    engine = LLMEngine(cfg, speculative=spec)
    if mode == "chain":
        misreport_draft_rows(engine.strategy.proposer, BAD + "/", BAD_POWER)
    served = count_loop_rounds(engine.strategy.proposer) if mode == "loop" else None
    with count_c_verified() as verified:
        pairs = sample_pairs(engine, groups)
    total = engine.stats().spec.total
    if served is not None:
        assert served["calls"] > 0 and served["sequences"] >= total.num_rounds // 2, (served, total.num_rounds)
        assert verified["chains"] >= total.num_rounds // 2, (verified, total.num_rounds)
    return pairs, total


@contextlib.contextmanager
def count_c_verified():
    """Counts the chains the C verifier (round_verify's plain-temperature path) settled."""
    from draftsmith.serve_eval.speculative import round_verify

    verified, inner = {"chains": 0}, round_verify.verify_plain_chains

    def counted(logits, root_rows, *args, **kwargs):
        out = inner(logits, root_rows, *args, **kwargs)
        verified["chains"] += 0 if out is None else len(root_rows)
        return out

    round_verify.verify_plain_chains = counted
    try:
        yield verified
    finally:
        round_verify.verify_plain_chains = inner


def count_loop_rounds(proposer) -> dict[str, int]:
    """Counts the standalone draft's decode calls the C loop served and the sequences in them."""
    served = {"calls": 0, "sequences": 0}
    inner = proposer.executor.draft_decode

    def draft_decode(first_tokens, *args, **kwargs):
        out = inner(first_tokens, *args, **kwargs)
        if out is not None:
            served["calls"] += 1
            served["sequences"] += len(first_tokens)
        return out

    proposer.executor.draft_decode = draft_decode
    return served


@pytest.fixture(scope="module")
def runs(models):
    cache: dict[str, tuple[dict[str, np.ndarray], dict]] = {}

    def get(mode: str):
        if mode not in cache:
            cache[mode] = run_mode(models, mode)
        return cache[mode]

    return get


@pytest.fixture(scope="module")
def exact(models):
    joints = {name: exact_pair_joint(models[0], t, p) for name, (t, p, _) in SETTINGS.items()}
    joints[MIN_TOKENS] = exact_pair_joint(models[0], *MIN_TOKENS_GROUP[:2], masked=STOP)
    return joints | {name: exact_pair_joint(models[4], t, p) for name, (t, p, _) in LOOP_SETTINGS.items()}


def pair_counts(pairs: np.ndarray) -> np.ndarray:  # [n, 2] -> [V, V]
    return np.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V).reshape(V, V)


@pytest.mark.parametrize("mode,setting", [(mode, setting) for mode in ("chain", "tree", "block") for setting in SETTINGS]
                         + [("loop", setting) for setting in LOOP_SETTINGS])
def test_first_two_speculated_tokens_follow_the_target_joint(runs, exact, mode, setting):
    """(x2, x3) under speculation, chain, tree and block at T 1.0 / 0.7 with top-p 0.8 and the C draft loop at a
    plain T 1.0, match the target's exact joint: chi-square at alpha 0.001 with power >= 0.9 against any TV-0.02
    error (see the module docstring); the same samples against a joint moved by TV 0.03 the worst way are
    rejected."""
    pairs, total = runs(mode)
    assert total.num_rounds >= sum(len(p) for p in pairs.values()), "some requests did not speculate"
    a1, a2 = total.acceptance_by_position
    # Rounds accepting no draft, exactly one and two all occur (a_1 also counts the K = 1 rounds).
    assert min(1 - a1, a1 - a2, a2) > 0.05, total.acceptance_by_position
    counts = pair_counts(pairs[setting])
    fit = chi_square_fit(counts, exact[setting], ALPHA, TV)
    assert fit.power >= MIN_POWER, f"design: power {fit.power:.3f} (df {fit.df}) against TV {TV}"
    assert fit.p_value > ALPHA, (
        f"{mode} {setting}: (x2, x3) differ from the target: p = {fit.p_value:.2e} (df {fit.df}); "
        f"empirical TV {total_variation(counts / counts.sum(), exact[setting]):.4f}\n"
        f"counts {counts.tolist()}\nexpected {(exact[setting] * counts.sum()).round(1).tolist()}")
    moved = worst_case_perturbation(exact[setting], CONTROL_TV)
    assert abs(total_variation(moved, exact[setting]) - CONTROL_TV) < 1e-9
    off = chi_square_fit(counts, moved, ALPHA, CONTROL_TV)
    assert off.power >= 0.999 and off.p_value < ALPHA, (off, f"the test cannot see a TV-{CONTROL_TV} error")


def test_negative_control_wrong_draft_scaling_is_rejected(runs, exact):
    """A chain proposer that reports q^2 / sum(q^2) instead of the row q its drafts were drawn from
    (T 0.7, top-p 0.8) is rejected by the same test: it sees a real engine-level exactness bug."""
    pairs, _ = runs("chain")
    reference = exact["T0.7-top_p0.8"]
    assert BAD_GROUP[:2] == SETTINGS["T0.7-top_p0.8"][:2]
    counts = pair_counts(pairs[BAD])
    fit = chi_square_fit(counts, reference, ALPHA, TV)
    assert fit.p_value < ALPHA, (
        f"wrongly scaled draft rows not detected: p = {fit.p_value:.2e}, empirical TV "
        f"{total_variation(counts / counts.sum(), reference):.4f}")


def test_min_tokens_group_follows_the_masked_joint(runs, exact):
    """Requests with min_tokens and a stop token (the chain run's MIN_TOKENS group) never emit it early, and their
    (x2, x3) follow the target joint with that token masked in every row: the same chi-square test and power."""
    pairs, _ = runs("chain")
    counts = pair_counts(pairs[MIN_TOKENS])
    assert counts[STOP].sum() == 0 and counts[:, STOP].sum() == 0, "a stop token was emitted before min_tokens"
    fit = chi_square_fit(counts, exact[MIN_TOKENS], ALPHA, TV)
    assert fit.power >= MIN_POWER, f"design: power {fit.power:.3f} (df {fit.df}) against TV {TV}"
    assert fit.p_value > ALPHA, (
        f"min_tokens: (x2, x3) differ from the masked target: p = {fit.p_value:.2e} (df {fit.df}); empirical TV "
        f"{total_variation(counts / counts.sum(), exact[MIN_TOKENS]):.4f}")
    # design: the mask moves the joint far beyond what the test resolves, so ignoring min_tokens would fail it
    assert total_variation(exact[MIN_TOKENS], exact[SETTINGS_OF_MIN_TOKENS]) > 10 * TV
