"""The cost model (pure: no processes) and the pure helpers of tessera.comm."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.comm import ALGORITHMS, CostParams, choose, predict
from tessera.comm._ops import combine, finish_mean
from tessera.comm.ring import split_bounds

# FORMULAS.md test vector: alpha = 10 us, beta = 1e-10 s/B, gamma = 0, p = 8, n = 1e8 B.
VECTOR = CostParams(alpha=1e-5, beta=1e-10, gamma=0.0)


def test_formulas_test_vector():
    assert predict("ring", 1e8, 8, VECTOR) == pytest.approx(1.764e-2, rel=1e-3)
    assert predict("butterfly", 1e8, 8, VECTOR) == pytest.approx(1.756e-2, rel=1e-3)  # Rabenseifner
    # recursive doubling, chosen by butterfly below 64 KB: lg p (alpha + n beta)
    assert predict("butterfly", 1e4, 8, VECTOR) == pytest.approx(3 * (1e-5 + 1e4 * 1e-10))
    assert predict("tree", 1e8, 8, VECTOR) == pytest.approx(2 * 3 * 1e-5 + 2 * 1e8 * 3 * 1e-10)
    assert predict("master_worker", 1e8, 8, VECTOR) == pytest.approx(2 * 7 * (1e-5 + 1e-2))


def test_ring_meets_the_bandwidth_lower_bound():
    # Patarasuk & Yuan 2009: T >= 2(p-1)/p * n / B; the ring's bandwidth term equals it.
    params = CostParams(alpha=0.0, beta=1e-9, gamma=0.0)
    for p in (2, 3, 8, 64):
        assert predict("ring", 1e6, p, params) == pytest.approx(2 * (p - 1) / p * 1e6 * 1e-9)


def test_choice_follows_the_regimes():
    params = CostParams(alpha=1e-4, alpha_native=1e-5, beta=1e-9, gamma=1e-10)
    candidates = ("ring", "tree", "butterfly")
    assert choose(64, 8, params, candidates=candidates) in ("tree", "butterfly")
    assert choose(64 << 20, 8, params, candidates=candidates) in ("ring", "butterfly")
    assert choose(1 << 20, 4, params) == "shm"  # one host: memory beats sockets
    assert choose(1 << 20, 4, params, candidates=("ring", "native")) == "native"  # C++ latency


def test_world_of_one_costs_nothing_and_unknown_names_fail():
    assert all(predict(name, 1e6, 1) == 0.0 for name in ALGORITHMS)
    with pytest.raises(ValueError):
        predict("smoke-signals", 1e3, 2)
    with pytest.raises(ValueError):
        CostParams(alpha=-1.0)


@settings(max_examples=200, deadline=None)
@given(
    name=st.sampled_from(ALGORITHMS),
    n=st.floats(0, 1e9),
    extra=st.floats(1, 1e9),
    p=st.integers(2, 64),
)
def test_predictions_are_positive_and_grow_with_size(name, n, extra, p):
    small, large = predict(name, n, p), predict(name, n + extra, p)
    assert 0 < small <= large and math.isfinite(large)


@settings(max_examples=200, deadline=None)
@given(numel=st.integers(0, 500), parts=st.integers(1, 9), unit=st.integers(1, 4))
def test_split_bounds_match_tensor_split(numel, parts, unit):
    rows = numel // unit
    chunks = torch.arange(rows * unit).reshape(rows, unit).tensor_split(parts)
    bounds = split_bounds(rows * unit, parts, unit)
    assert [(hi - lo) // unit for lo, hi in bounds] == [c.shape[0] for c in chunks]
    assert bounds[0][0] == 0 and bounds[-1][1] == rows * unit


def test_ops_and_integer_mean():
    acc = torch.tensor([1, 5, -3])
    combine(acc, torch.tensor([2, 2, 2]), "max")
    assert acc.tolist() == [2, 5, 2]
    combine(acc, torch.tensor([3, 1, 2]), "product")
    assert acc.tolist() == [6, 5, 4]
    finish_mean(acc, "mean", 4)
    assert acc.tolist() == [1, 1, 1]  # integers: floor division
