"""draftsmith.kernels.sampling: logits -> probs transforms (against a naive per-row reference) and sampling."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from draftsmith.kernels.sampling import logits_to_probs, sample, sample_logits, uniforms


def reference_probs(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float] | None:
    """Straight-from-the-definition single-row reference (python floats); None on a float-tie boundary."""
    vocab = len(logits)
    if temperature == 0:
        best = max(range(vocab), key=lambda i: (logits[i], -i))
        return [1.0 if i == best else 0.0 for i in range(vocab)]
    scaled = [x / temperature for x in logits]
    order = sorted(range(vocab), key=lambda i: (-scaled[i], i))
    kept = order[:top_k] if 0 < top_k < vocab else order
    top = max(scaled[i] for i in kept)
    weights = {i: math.exp(scaled[i] - top) for i in kept}
    if top_p < 1:
        total = sum(weights.values())
        mass, nucleus = 0.0, []
        for i in kept:
            if abs(mass - top_p) < 1e-5:  # float rounding decides this boundary; not a semantic case
                return None
            if nucleus and mass >= top_p:
                break
            nucleus.append(i)
            mass += weights[i] / total
        weights = {i: weights[i] for i in nucleus}
    total = sum(weights.values())
    return [weights.get(i, 0.0) / total for i in range(vocab)]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(-6, 6), min_size=2, max_size=12),  # small ints -> ties are exercised
    st.sampled_from([0.0, 0.5, 0.7, 1.0, 1.5]),
    st.integers(0, 14),
    st.sampled_from([1.0, 0.95, 0.8, 0.5, 0.1]),
)
def test_logits_to_probs_matches_reference(logits, temperature, top_k, top_p):
    """Temperature / top-k (ties by lower id) / top-p (smallest prefix reaching top_p) equal the naive definition."""
    want = reference_probs([float(x) for x in logits], temperature, top_k, top_p)
    assume(want is not None)
    want = torch.tensor(want)
    got = logits_to_probs(torch.tensor([logits], dtype=torch.float32), temperature, top_k, top_p)[0]
    assert torch.allclose(got, want, atol=1e-5), (got, want)
    assert abs(float(got.sum()) - 1) < 1e-5


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 2**31 - 1),
    st.sampled_from([1, 3, 8, 20]),   # k well below V = 1024: the candidate window is narrower than the row
    st.sampled_from([1.0, 0.9, 0.5]),
    st.sampled_from([3, 12, 60]),     # distinct values per row: few -> ties run past the window (full-row fallback)
)
def test_wide_rows_with_ties_at_the_kth_place_match_reference(seed, top_k, top_p, num_values):
    """bf16-like logits (few distinct values, many ties at the k-th place) on rows wider than the top-k window:
    the windowed tie rule (over topk_rows' group prefilter) and its full-row fallback both equal the naive
    definition, row by row, in one batch."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, num_values, (4, 1024), generator=gen).float() / 4
    got = logits_to_probs(logits, 0.8, top_k, top_p)
    for row in range(logits.shape[0]):
        want = reference_probs(logits[row].tolist(), 0.8, top_k, top_p)
        if want is not None:
            assert torch.allclose(got[row], torch.tensor(want), atol=1e-5), row


def test_rows_use_their_own_parameters():
    """A batch with different params per row equals each row transformed alone."""
    torch.manual_seed(0)
    logits = torch.randn(5, 20)
    temps, ks, ps = [0.0, 0.7, 1.0, 1.3, 1.0], [0, 5, 0, 3, 19], [1.0, 1.0, 0.9, 0.5, 0.99]
    batch = logits_to_probs(logits, torch.tensor(temps), torch.tensor(ks), torch.tensor(ps))
    for i in range(5):
        alone = logits_to_probs(logits[i : i + 1], temps[i], ks[i], ps[i])
        assert torch.allclose(batch[i], alone[0])


def test_temperature_zero_is_one_hot_at_first_argmax():
    """Greedy rows are one-hot at the first maximal logit."""
    probs = logits_to_probs(torch.tensor([[1.0, 3.0, 3.0, 0.0]]), 0.0)
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=1.0, top_k=-1), "top_k"),
        (dict(temperature=1.0, top_p=0.0), "top_p"),
        (dict(temperature=1.0, top_p=1.5), "top_p"),
        (dict(temperature=[1.0, 1.0, 1.0]), "temperature has shape \\(3,\\) but logits has 2 rows"),
        (dict(temperature=1.0, top_k=[1, 2, 3]), "top_k has shape \\(3,\\) but logits has 2 rows"),
    ],
)
def test_bad_parameters_raise_naming_field(kwargs, field):
    """Invalid sampling parameters or per-row shapes raise ValueError naming the field (and both sizes)."""
    with pytest.raises(ValueError, match=field):
        logits_to_probs(torch.zeros(2, 4), **kwargs)


def test_sample_follows_probs():
    """Inverse-CDF sampling reproduces the distribution (chi-square, alpha 1e-3) and never picks p=0."""
    probs = torch.tensor([0.5, 0.2, 0.0, 0.15, 0.1, 0.05])
    n = 60_000
    draws = sample(probs.expand(n, -1), torch.Generator().manual_seed(1))
    counts = torch.bincount(draws, minlength=6).double()
    assert counts[2] == 0
    support = probs > 0
    assert chisquare(counts[support].numpy(), (probs[support].double() * n).numpy()).pvalue > 1e-3


def test_sample_at_the_top_of_the_cdf_stays_on_the_support(monkeypatch):
    """A draw at the very top of the CDF (forced here with u = 1; a parallel cumsum's rounding can land
    there) takes the row's last positive entry, never a zero-probability tail token nor an index past the
    vocabulary; an empty batch gives no tokens."""
    import draftsmith.kernels.sampling as sampling

    monkeypatch.setattr(sampling, "uniforms", lambda counts, rows, *a, **k: torch.ones(rows, 1, dtype=torch.float64))
    probs = torch.tensor([[0.25, 0.75, 0.0, 0.0], [0.1, 0.0, 0.9, 0.0], [0.0, 0.0, 0.0, 1.0]])
    assert sample(probs).tolist() == [1, 2, 3]
    assert sample(torch.zeros(0, 4)).shape == (0,)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 2**31 - 1),
    st.sampled_from([48, 1024]),     # 1024: the k-window is narrower than the row and topk_rows prefilters
    st.sampled_from([None, 3, 40]),  # distinct values per row (bf16-like ties; few: the window's tie fallback)
    st.sampled_from(["per-row", "one", "global"]),
    st.booleans(),                   # every row windowed, as a batch of requests with one top-k is
)
def test_sample_logits_draws_what_sample_of_logits_to_probs_draws(seed, vocab, num_values, generators, all_windowed):
    """Greedy, full-row and windowed rows mixed in one batch, or every row windowed at k 20 (through topk_rows'
    prefilter at V = 1024): sample_logits draws the same token as
    sample(logits_to_probs(...)) from the same generators, so the same law. Where the two differ, the row's
    uniform sits on a CDF boundary that the window's and the full row's float32 softmax round differently."""
    gen = torch.Generator().manual_seed(seed)
    num_rows = 12
    logits = (torch.randn(num_rows, vocab, generator=gen) * 3 if num_values is None else
              torch.randint(0, num_values, (num_rows, vocab), generator=gen).float() / 4)
    temps = torch.tensor([0.0, 0.7, 1.0, 1.3])[torch.randint(0, 4, (num_rows,), generator=gen)]
    ks = torch.tensor([0, 1, 5, 50, vocab - 1])[torch.randint(0, 5, (num_rows,), generator=gen)]
    ps = torch.tensor([1.0, 0.9, 0.5])[torch.randint(0, 3, (num_rows,), generator=gen)]
    if all_windowed:
        temps, ks = torch.full((num_rows,), 0.8), torch.full((num_rows,), 20)

    def draw_from(row_seed: int):
        if generators == "per-row":
            return [torch.Generator().manual_seed(row_seed + i) for i in range(num_rows)]
        return torch.Generator().manual_seed(row_seed) if generators == "one" else None

    for draw in range(3):
        if generators == "global":
            torch.manual_seed(seed + draw)
        got = sample_logits(logits, temps, ks, ps, draw_from(seed + draw))
        if generators == "global":
            torch.manual_seed(seed + draw)
        probs = logits_to_probs(logits, temps, ks, ps)
        want = sample(probs, draw_from(seed + draw))
        if generators == "global":
            torch.manual_seed(seed + draw)
        u = uniforms(1, num_rows, draw_from(seed + draw)).squeeze(1)
        cdf = probs.double().cumsum(dim=-1)
        for row in (got != want).nonzero().squeeze(1).tolist():
            boundary = cdf[row, min(got[row], want[row])]
            assert abs(u[row] * cdf[row, -1] - boundary) < 1e-5, (row, got[row], want[row])
        assert bool((probs.gather(1, got[:, None]) > 0).all())


def test_sample_logits_takes_empty_batches_and_refuses_bad_values():
    assert sample_logits(torch.zeros(0, 8), 1.0, 2).shape == (0,)
    with pytest.raises(ValueError, match="top_p"):
        sample_logits(torch.zeros(2, 8), 1.0, 2, 1.5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_uniforms_mix_request_generators_and_the_device_rng_on_cuda():
    """A request's CPU generator and a None entry (drawn on the device) land in one CUDA tensor."""
    out = uniforms(1, 2, [torch.Generator().manual_seed(0), None], "cuda")
    assert out.device.type == "cuda" and out.shape == (2, 1)


def test_sample_per_row_generators_are_batch_invariant():
    """Row i's sample depends only on its own generator: same draws alone or next to other rows."""
    probs = torch.softmax(torch.randn(4, 50), dim=-1)
    for seed in range(10):
        batch = sample(probs, [torch.Generator().manual_seed(seed + i) for i in range(4)])
        for i in range(4):
            alone = sample(probs[i : i + 1], [torch.Generator().manual_seed(seed + i)])
            assert alone.item() == batch[i].item()


def test_sample_one_hot_rows_return_argmax():
    """Temperature-0 (one-hot) rows sample their argmax whatever the noise."""
    probs = logits_to_probs(torch.randn(64, 30), 0.0)
    assert torch.equal(sample(probs, torch.Generator().manual_seed(0)), probs.argmax(-1))


def test_uniforms_draw_only_each_rows_count():
    """Per-row uniforms consume exactly counts[i] draws, padding with 1.0 (never accepts)."""
    gens = [torch.Generator().manual_seed(5), torch.Generator().manual_seed(6)]
    out = uniforms([2, 3], 2, gens)
    assert out.dtype == torch.float64 and out.shape == (2, 3) and out[0, 2] == 1.0
    assert torch.equal(out[1], torch.rand(3, dtype=torch.float64, generator=torch.Generator().manual_seed(6)))


@settings(max_examples=200, deadline=None)
@given(temperature=st.one_of(st.floats(min_value=0, allow_nan=False, allow_infinity=False),
                             st.sampled_from([0.0, 1e-45, 1e-50, 1e-4, 1e38, 1e39, 3.5e38])),
       top_p=st.one_of(st.floats(min_value=0, max_value=1, allow_nan=False),
                       st.sampled_from([1e-50, 1e-45, 1e-38, 1.0])),
       top_k=st.one_of(st.integers(0, 10), st.sampled_from([2**63 - 1, 2**63, 10**30])),
       seed=st.one_of(st.none(), st.integers(-(2**64), 2**64)))
def test_values_that_pass_the_check_never_fail_in_the_kernels(temperature, top_p, top_k, seed):
    """Property: whatever check_sampling_values accepts, logits_to_probs and sample take without
    raising and turn into finite probabilities (float64 values that break only in float32, such as
    temperature 1e39 or top_p 1e-50, are refused by the check, not by the batch)."""
    from draftsmith.kernels.sampling import check_sampling_values
    try:
        check_sampling_values(temperature, top_k, top_p, seed)
    except ValueError as exc:
        assert str(exc).split()[0] in {"temperature", "top_p", "top_k", "seed"}
        return
    logits = torch.randn(3, 50) * 30
    probs = logits_to_probs(logits, temperature, top_k, top_p)
    assert bool(torch.isfinite(probs).all()) and torch.allclose(probs.sum(-1), torch.ones(3))
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    assert sample(probs, generator).shape == (3,)
