"""Is one strategy faster than another, from repeated runs whose times move between repeats?

On a machine whose step time moves by 10-30% between runs minutes apart, the strategy with the
lowest median of a few repeats is not shown to be the fastest where the others are within that
spread: which of several equally fast rows comes first is a draw. `faster_p` is the one-sided
exact Mann-Whitney test (Mann and Whitney 1947): no assumption about the shape of the times'
spread, exact for the handful of repeats a benchmark affords, on the repeats' own medians (the
units that are repeated; the steps within one run share that run's conditions).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

__all__ = ["faster_p"]


def faster_p(fast: Sequence[float], slow: Sequence[float]) -> float:
    """One-sided exact Mann-Whitney p-value that `fast` is drawn faster than `slow`: of every
    way to split the pooled values into groups of their sizes (equally likely if neither is
    faster), the share whose first group beats the second in at least as many pairs as
    `fast` beats `slow` (a tie counts half). The splits are counted one by one: a few repeats
    each (10 + 10 values: 184,756 splits), not thousands of samples."""
    if not fast or not slow:
        raise ValueError("faster_p needs at least one time in each group")

    def wins(a: Sequence[float], b: Sequence[float]) -> float:
        return sum((x < y) + 0.5 * (x == y) for x in a for y in b)

    pooled = [*fast, *slow]
    seen = wins(fast, slow)
    splits = list(itertools.combinations(range(len(pooled)), len(fast)))
    beat = 0
    for chosen in splits:
        first = [pooled[k] for k in chosen]
        rest = [pooled[k] for k in range(len(pooled)) if k not in chosen]
        beat += wins(first, rest) >= seen
    return beat / len(splits)
