"""Tolerances derived from the computation, not round numbers that pass on one CPU.

A float32 result of tessera (sums split over ranks, reduced in another order) and a float32
result of the test's own oracle (one process, the whole batch) both differ from the exact answer
by rounding. Neither is "the" answer, so comparing them with a fixed `atol=1e-5` only says that
this CPU's kernels happened to round within it; another CPU's kernels (AVX-512 sums in another
order) then fail a correct implementation. Instead we compute the same thing in float64 (the
"reference", ~1e-16 relative: exact for our purposes) and require

    |tessera - reference| <= FACTOR * |oracle - reference| + floor

per tensor, in the Euclidean norm over its elements (the max of one element is a tail statistic
that scatters by 4x between two correct runs; the norm is stable, and a wrong element still
raises it by its full error). The oracle's own distance measures how much rounding this
computation accumulates on this machine (it grows with steps, reduction length and with AdamW's
amplification), and a correct reordering of the same float32 operations rounds by the same order
of magnitude. FACTOR = 4: tessera adds one reduction level (each rank sums its shard, then the
ranks' means are averaged) and its partial sums round independently of the oracle's; the
worst-case bound of a recursive sum grows with the number of roundings, which at most doubles
here, and a factor 2 on top absorbs the spread of rounding between two runs. A real bug
(a gradient off by a constant factor, a step too early, a stale value) is orders of magnitude
larger. The floor covers a tensor the oracle happens to compute exactly: `ulps` float32 units of
the reference's magnitude.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch

FACTOR = 4.0
"""Allowed multiple of the oracle's own float32 error (see the module docstring for why 4)."""

FP32_ULP = torch.finfo(torch.float32).eps
BF16_ULP = torch.finfo(torch.bfloat16).eps


def _distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """Euclidean norm of `a - b` over all elements, in float64."""
    return (a.double() - b.double()).norm().item() if b.numel() else 0.0


def _as_items(value: Any) -> list[tuple[str, torch.Tensor]]:
    if isinstance(value, Mapping):
        return [(str(k), torch.as_tensor(v)) for k, v in value.items()]
    if isinstance(value, torch.Tensor):
        return [("tensor", value)]
    if isinstance(value, Iterable):
        items = list(value)
        if items and all(isinstance(v, numbers.Real) for v in items):  # StepLoss is one
            return [("values", torch.tensor([float(v) for v in items], dtype=torch.float64))]
        return [(str(i), torch.as_tensor(v)) for i, v in enumerate(items)]
    return [("value", torch.tensor(float(value), dtype=torch.float64))]


def error_budget(
    oracle: torch.Tensor,
    reference: torch.Tensor,
    *,
    factor: float = FACTOR,
    ulps: float = 16.0,
    ulp: float = FP32_ULP,
) -> float:
    """`factor * ||oracle - reference|| + ulps * ulp * ||reference||` for one tensor."""
    magnitude = reference.double().norm().item() if reference.numel() else 0.0
    return factor * _distance(oracle, reference) + ulps * ulp * max(magnitude, 1e-30)


def check_close(
    ours: Any,
    oracle: Any,
    reference: Any,
    *,
    factor: float = FACTOR,
    ulps: float = 16.0,
    ulp: float = FP32_ULP,
    what: str = "",
) -> dict[str, tuple[float, float]]:
    """Assert every tensor of `ours` is within `error_budget` of the float64 `reference`.

    `ours`, `oracle` and `reference` are tensors, sequences of tensors or numbers, or mappings
    with the same keys. Returns {name: (error, budget)} for reporting. The message names the
    tensor, both distances and the budget, so a failure says how far off it was.
    """
    mine, theirs, exact = _as_items(ours), _as_items(oracle), _as_items(reference)
    assert [k for k, _ in mine] == [k for k, _ in exact], (what, "different tensors")
    assert [k for k, _ in theirs] == [k for k, _ in exact], (what, "different tensors")
    found = {}
    for (name, a), (_, b), (_, r) in zip(mine, theirs, exact):
        assert a.shape == r.shape, (what, name, tuple(a.shape), tuple(r.shape))
        error = _distance(a, r)
        budget = error_budget(b, r, factor=factor, ulps=ulps, ulp=ulp)
        assert error <= budget, (
            f"{what} {name}: ||ours - float64|| = {error:.3e} exceeds {budget:.3e} "
            f"({factor} x the oracle's ||oracle - float64|| = {_distance(b, r):.3e}, "
            f"+ {ulps} ulps of ||float64||)"
        )
        found[name] = (error, budget)
    if os.environ.get("TESSERA_TOLERANCE_REPORT"):  # how close each check comes to its bound
        worst = max((e / b for e, b in found.values()), default=0.0)
        print(f"tolerance: {what}: worst error / budget = {worst:.3f}")
    return found


def to_float64(value: Any) -> Any:
    """A copy of a tensor / state dict with floating tensors in float64 (for the reference)."""
    if isinstance(value, Mapping):
        return {k: to_float64(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().double()
    return value
