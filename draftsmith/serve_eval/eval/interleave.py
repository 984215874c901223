"""Side-by-side timing, the one way every measurement here runs its methods: repetitions interleaved
across methods, the order rotated each repetition, so that a slow spell of the machine (another job,
a thermal dip) falls on every method alike instead of on whichever ran during it.

The eval harness, the step-cost probe and the benchmark scripts all go through `rotation` or `interleave`.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def rotation(items: Sequence[T], rep: int) -> list[T]:
    """`items` in the order repetition `rep` runs them: started at item rep mod len, wrapping round."""
    start = rep % max(len(items), 1)
    return [*items[start:], *items[:start]]


def interleave(calls: Mapping[str, Callable[[], R]], repeats: int) -> dict[str, list[R]]:
    """Each call's result per repetition (in repetition order): every call runs once per repetition
    before the next repetition starts, in the rotated order."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    results: dict[str, list[R]] = {name: [] for name in calls}
    for rep in range(repeats):
        for name in rotation(list(calls), rep):
            results[name].append(calls[name]())
    return results
