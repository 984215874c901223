"""The one interleaving every timed comparison uses: each repetition runs every method once, the order
rotated, so each method is first (and last) equally often."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from draftsmith.serve_eval.eval.interleave import interleave, rotation


@given(st.lists(st.integers(), min_size=1, max_size=8, unique=True), st.integers(0, 50))
def test_a_rotation_is_a_cyclic_shift_of_all_items(items, rep):
    turned = rotation(items, rep)
    assert sorted(turned) == sorted(items) and turned[0] == items[rep % len(items)]
    assert rotation(items, rep + len(items)) == turned


@given(st.integers(1, 6), st.integers(1, 12))
def test_every_method_runs_once_per_repetition_and_leads_equally_often(num_methods, repeats):
    calls: list[tuple[int, str]] = []
    names = [f"m{i}" for i in range(num_methods)]
    done: dict[str, int] = {n: 0 for n in names}

    def call(name):
        def run():
            done[name] += 1
            calls.append((sum(done.values()), name))
            return done[name]
        return run

    results = interleave({n: call(n) for n in names}, repeats)
    assert results == {n: list(range(1, repeats + 1)) for n in names}   # in repetition order
    blocks = [[n for _, n in calls[i:i + num_methods]] for i in range(0, len(calls), num_methods)]
    assert all(sorted(b) == sorted(names) for b in blocks)                # one of each per repetition
    leaders = [b[0] for b in blocks]
    counts = [leaders.count(n) for n in names]
    assert max(counts) - min(counts) <= 1


def test_no_repetition_is_an_error():
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        interleave({"a": lambda: 1}, 0)
