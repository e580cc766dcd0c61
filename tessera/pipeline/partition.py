"""Cut an `nn.Sequential` into contiguous stages: by given layer counts, parameters or time.

A pipeline runs as fast as its slowest stage, so the cut minimises the largest stage cost. With
costs c_1..c_n and p stages this is the linear partition problem; the dynamic programme below is
exact in O(p n^2) (n is a few hundred layers at most). Cost is the parameter count by default
(GPipe's and torch pipelining's heuristic); `measure_layer_times` gives a cost by measured time.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import nn

__all__ = [
    "balance_by_cost",
    "balance_from_split",
    "check_balance",
    "measure_layer_times",
    "parameter_costs",
    "stage_bounds",
]


def check_balance(balance: Sequence[int], num_layers: int, num_stages: int) -> list[int]:
    """Validate layer counts per stage; ValueError unless they cover the model exactly."""
    balance = [int(b) for b in balance]
    if len(balance) != num_stages:
        raise ValueError(f"balance {balance} has {len(balance)} stages, the group {num_stages}")
    if any(b < 1 for b in balance):
        raise ValueError(f"balance {balance}: every stage needs at least one layer")
    if sum(balance) != num_layers:
        raise ValueError(
            f"balance {balance} covers {sum(balance)} layers, the model has {num_layers}"
        )
    return balance


def balance_from_split(num_layers: int, split: Sequence[str], num_stages: int) -> list[int] | None:
    """Layer counts of an `nn.Sequential` whose stages start at top-level layers `split` ("3");
    None if a split point is not a top-level layer (the model is then traced, `trace.py`)."""
    if not all(str(name).isdigit() for name in split):
        return None
    if len(split) + 1 != num_stages:
        raise ValueError(
            f"split={list(split)} gives {len(split) + 1} stages, but the pipeline has "
            f"{num_stages} ranks (interleaved: ranks x virtual stages): name {num_stages - 1} "
            "module(s) where a new stage starts"
        )
    starts = [0]
    for name in split:
        if int(name) >= num_layers:
            raise ValueError(f"split point {name!r}: the nn.Sequential has no submodule {name!r}")
        if int(name) <= starts[-1]:
            raise ValueError(
                f"split point {name!r} leaves the stage before it empty (split={list(split)})"
            )
        starts.append(int(name))
    return [end - start for start, end in zip(starts, starts[1:] + [num_layers])]


def balance_by_cost(costs: Sequence[float], num_stages: int) -> list[int]:
    """Layer counts per stage minimising the largest stage's summed cost (contiguous stages)."""
    n = len(costs)
    if num_stages < 1 or num_stages > n:
        raise ValueError(f"cannot cut {n} layers into {num_stages} non-empty stages")
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + float(cost))
    inf = float("inf")
    # best[k][j]: smallest largest-stage cost of the first j layers in k stages; cut[k][j] the
    # start of the last stage in that optimum.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], prefix[j] - prefix[i])
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    counts, j = [], n
    for k in range(num_stages, 0, -1):
        counts.append(j - cut[k][j])
        j = cut[k][j]
    return counts[::-1]


def stage_bounds(balance: Sequence[int]) -> list[tuple[int, int]]:
    """`[start, end)` layer indices of each stage."""
    bounds, start = [], 0
    for count in balance:
        bounds.append((start, start + count))
        start += count
    return bounds


def parameter_costs(model: nn.Sequential) -> list[float]:
    """Parameters per layer (a parameter shared by several layers counts in each)."""
    return [float(sum(p.numel() for p in layer.parameters())) for layer in model]


@torch.no_grad()
def measure_layer_times(
    model: nn.Sequential, sample: torch.Tensor, repeats: int = 3
) -> list[float]:
    """Median forward time of each layer on `sample` (forward time tracks backward's ~1:2)."""
    times, x = [], sample
    for layer in model:
        runs = []
        for _ in range(repeats):
            began = time.perf_counter()
            y = layer(x)
            runs.append(time.perf_counter() - began)
        times.append(sorted(runs)[len(runs) // 2])
        x = y
    return times
