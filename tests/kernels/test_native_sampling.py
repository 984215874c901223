"""The C sampler and chain verifier (kernels.native_sampling) against the torch rules they replace:
kernels.sampling.sample_logits for a decode row (plain temperature, or top-k / top-p filtered, ties included), verify_fast.sampled_chain_accept over logits_to_probs
rows for speculative chains. Same generators, same uniforms: the same tokens (the softmax differs by fp32
rounding only, far from these draws' boundaries)."""
from __future__ import annotations

import pytest
import torch

from draftsmith.kernels.native_sampling import inverse_temperatures, sample_rows, verify_plain_chains
from draftsmith.kernels.sampling import logits_to_probs, sample_logits
from draftsmith.serve_eval.speculative.verify_fast import sampled_chain_accept
from spec_helpers import params

V = 64
pytestmark = pytest.mark.skipif(sample_rows(torch.zeros(1, V), [params(1.0)], None) is None,
                                reason="the native CPU kernels do not build or run here")


def generators(seed: int, n: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed * 100 + i) for i in range(n)]


@pytest.mark.parametrize("seed", range(6))
def test_plain_rows_draw_the_tokens_sample_logits_draws(seed):
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(seed)) * 3
    temps = [0.3, 0.7, 1.0, 1.6, 4.0]
    got = sample_rows(logits, [params(t, k) for t, k in zip(temps, [0, V, 0, 0, V + 5])], generators(seed, 5))
    want = sample_logits(logits, temps, [0] * 5, [1.0] * 5, generators(seed, 5))
    assert torch.equal(got, want)
    # one shared generator for every row, as an engine draws for unseeded requests
    shared = sample_rows(logits, [params(t) for t in temps], torch.Generator().manual_seed(seed))
    assert torch.equal(shared, sample_logits(logits, temps, 0, 1.0, torch.Generator().manual_seed(seed)))


@pytest.mark.parametrize("seed", range(40))
def test_filtered_rows_draw_the_tokens_sample_logits_draws(seed):
    """Top-k (ties at the k-th value settled by id), top-p (its window widened for flat rows, up to the whole
    row), both, and plain rows in one batch: the same token as the torch filters at the same uniform."""
    g = torch.Generator().manual_seed(seed)
    vocab = int(torch.randint(8, 600, (1,), generator=g))
    logits = torch.randn(8, vocab, generator=g) * float(torch.rand(1, generator=g) * 6)
    if seed % 3 == 0:
        logits = logits.round()   # many ties, at the k-th place and in the nucleus' order
    temps = [float(t) for t in torch.rand(8, generator=g) * 2 + 0.05]
    top_k = [0, 0, 1, 3, vocab - 1, vocab, int(torch.randint(1, vocab, (1,), generator=g)), 0]
    top_p = [1.0, 0.9, 1.0, 0.5, 0.99, 0.3, float(torch.rand(1, generator=g)) + 1e-3, 0.999]
    settings = [params(t, k, p) for t, k, p in zip(temps, top_k, top_p)]
    got = sample_rows(logits, settings, generators(seed, 8))
    assert torch.equal(got, sample_logits(logits, temps, top_k, top_p, generators(seed, 8)))


def test_a_filtered_row_never_draws_outside_its_filter():
    """Top-k 3 over a row with a 5-way tie at the top keeps ids 0-2 only; top-p 0.5 over a row with one dominant
    token always draws it; masked (-inf) entries never come out."""
    vocab = 32
    tied = torch.zeros(1, vocab)
    tied[0, :5] = 4.0
    draws = {int(sample_rows(tied, [params(1.0, 3)], torch.Generator().manual_seed(i))[0]) for i in range(200)}
    assert draws == {0, 1, 2}
    dominant = torch.zeros(1, vocab)
    dominant[0, 7] = 6.0
    draws = {int(sample_rows(dominant, [params(1.0, 0, 0.5)], torch.Generator().manual_seed(i))[0]) for i in range(200)}
    assert draws == {7}
    masked = torch.randn(1, vocab).masked_fill(torch.arange(vocab) % 2 == 0, float("-inf"))
    draws = {int(sample_rows(masked, [params(2.0, vocab - 1, 0.95)], torch.Generator().manual_seed(i))[0])
             for i in range(300)}
    assert draws and all(d % 2 == 1 for d in draws)


def test_greedy_or_non_fp32_rows_are_left_to_the_torch_path():
    """The decode sampler leaves greedy and non-fp32 rows to torch; the chain verifier and the draft loop (which read
    inverse_temperatures) also leave filtered rows to it."""
    assert inverse_temperatures([params(1.0), params(1.0, 5)], V) is None    # top-k
    assert inverse_temperatures([params(1.0), params(1.0, 0, 0.9)], V) is None    # top-p
    assert inverse_temperatures([params(1.0), params(0.0)], V) is None    # greedy, unless greedy_ok
    assert inverse_temperatures([params(2.0), params(0.0)], V, greedy_ok=True).tolist() == [0.5, 0.0]
    logits = torch.randn(2, V)
    assert sample_rows(logits, [params(1.0), params(0.0)], None) is None    # greedy beside a plain row
    assert sample_rows(logits, [params(1.0, 5), params(0.0)], None) is None    # greedy beside a filtered row
    assert sample_rows(logits.double(), [params(1.0)] * 2, None) is None
    assert sample_rows(logits.double(), [params(1.0, 5)] * 2, None) is None


def chain_case(seed: int, batch: int, width: int, dense: bool, mixed_points: bool):
    """Logits rows for `batch` chains (root + nodes each, with a gap row between chains), their tokens, node
    counts and draft rows; drafts drawn from q or the target's own argmax, so tests both accept and reject."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(1, width + 1, (batch,), generator=g).tolist()
    counts[0] = width
    roots, rows = [], 0
    for n in counts:
        roots.append(rows + 1)
        rows += n + 2
    logits = torch.randn(rows, V, generator=g) * 2.5
    q = torch.softmax(torch.randn(batch, width, V, generator=g) * 2.5, -1) if dense else None
    tokens = torch.zeros(batch, width, dtype=torch.int64)
    for b, (root, n) in enumerate(zip(roots, counts)):
        for i in range(n):
            like_target = bool(torch.rand(1, generator=g) < 0.5)
            tokens[b, i] = (int(logits[root + i].argmax()) if like_target or q is None
                            else int(torch.multinomial(q[b, i], 1, generator=g)))
    point_mass = None
    if dense and mixed_points:
        point_mass = torch.rand(batch, width, generator=g) < 0.3
    return logits, roots, tokens, counts, q, point_mass


@pytest.mark.parametrize("dense,mixed_points", [(True, False), (True, True), (False, False)])
@pytest.mark.parametrize("seed", range(8))
def test_chains_verify_as_the_closed_form_does(seed, dense, mixed_points):
    batch, width, temps = 3, 4, [1.0, 0.6, 1.7]
    logits, roots, tokens, counts, q, point_mass = chain_case(seed, batch, width, dense, mixed_points)
    got_tokens, got_accepted = verify_plain_chains(logits, roots, tokens, counts, q, point_mass,
                                                   [params(t) for t in temps], generators(seed, batch))
    index = torch.tensor(roots)[:, None] + torch.arange(width + 1)[None]
    rows = logits[index.clamp_max(logits.shape[0] - 1)]
    target = logits_to_probs(rows.reshape(-1, V), torch.tensor(temps).repeat_interleave(width + 1), 0,
                             1.0).view(batch, width + 1, V)
    want_tokens, want_accepted, _ = sampled_chain_accept(tokens, target, generators(seed, batch), q, point_mass,
                                                         torch.tensor(counts))
    assert torch.equal(got_accepted, want_accepted)
    assert torch.equal(got_tokens, want_tokens)


@pytest.mark.parametrize("seed", range(4))
def test_chains_sharing_one_generator_draw_in_the_closed_forms_order(seed):
    """Unseeded requests share the engine's generator: every chain's accept tests come first, then every final
    draw, as sampled_chain_accept draws them, so the same values land on the same chains."""
    batch, width, temps = 3, 4, [1.0, 0.6, 1.7]
    logits, roots, tokens, counts, q, _ = chain_case(seed, batch, width, True, False)
    shared = torch.Generator().manual_seed(seed)
    got_tokens, got_accepted = verify_plain_chains(logits, roots, tokens, counts, q, None,
                                                   [params(t) for t in temps], [shared] * batch)
    index = (torch.tensor(roots)[:, None] + torch.arange(width + 1)[None]).clamp_max(logits.shape[0] - 1)
    target = logits_to_probs(logits[index].reshape(-1, V), torch.tensor(temps).repeat_interleave(width + 1), 0,
                             1.0).view(batch, width + 1, V)
    replay = torch.Generator().manual_seed(seed)
    want_tokens, want_accepted, _ = sampled_chain_accept(tokens, target, [replay] * batch, q, None,
                                                         torch.tensor(counts))
    assert torch.equal(got_accepted, want_accepted) and torch.equal(got_tokens, want_tokens)


def test_chains_the_c_verifier_cannot_read_are_refused():
    logits, roots, tokens, counts, q, _ = chain_case(1, 2, 3, True, False)
    with pytest.raises(ValueError, match="draft rows"):
        verify_plain_chains(logits, roots, tokens, counts, q[:, :2], None, [params(1.0)] * 2, [None] * 2)
    with pytest.raises(ValueError, match="outside"):
        verify_plain_chains(logits, [roots[0], logits.shape[0] - 1], tokens, counts, q, None, [params(1.0)] * 2,
                            [None] * 2)


def test_chains_accept_rejects_and_full_accepts_all_occur():
    """The cases above reach every branch: a rejection at the first node, a partial run, a full accept."""
    seen = set()
    for seed in range(8):
        logits, roots, tokens, counts, q, point_mass = chain_case(seed, 3, 4, True, False)
        _, accepted = verify_plain_chains(logits, roots, tokens, counts, q, point_mass,
                                          [params(t) for t in (1.0, 0.6, 1.7)], generators(seed, 3))
        seen |= {"none" if a == 0 else "all" if a == n else "some" for a, n in zip(accepted.tolist(), counts)}
    assert seen == {"none", "some", "all"}


def test_a_draft_token_outside_the_vocabulary_is_refused():
    logits, roots, tokens, counts, q, _ = chain_case(0, 1, 2, True, False)
    tokens[0, 0] = V + 3
    with pytest.raises(ValueError, match="outside the vocabulary"):
        verify_plain_chains(logits, roots, tokens, counts, q, None, [params(1.0)], [None])
