"""Fit the cost model's parameters on a live group: `calibrate`.

Kept apart from `cost.py` so the model stays pure (no collective, no I/O) and `api.py`, which
asks the model, is not imported back by it: calibration runs the collectives it measures.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, replace

import torch
import torch.distributed as dist

from tessera.comm import api
from tessera.comm._p2p import group_info
from tessera.comm.cost import DEFAULT_PARAMS, CostParams, set_params

__all__ = ["calibrate"]


def _typical_time(fn, repeats: int) -> float:
    # The median of back-to-back calls: what a collective costs in use on this machine,
    # scheduling and Python overhead included (a quiet best case was 3-10x too optimistic).
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def calibrate(group: dist.ProcessGroup | None = None, *, repeats: int = 15) -> CostParams:
    """Fit α, β, γ, μ, σ and α_native on the live group; cache and return them.

    Collective: every rank of `group` must call it. Each parameter comes from the median of
    `repeats` runs of the operation it describes: α from tessera's binomial-tree allreduce of
    one element (2⌈lg p⌉ messages), α_native from gloo's allreduce of one element, β from
    gloo's allreduce of 4 MB (every rank sending at once; at least 2μ, as a message is copied at
    least twice), γ and μ from a local `add_` and `copy_` of 16 MB, σ from tessera's shm
    allreduce of one element (two barriers). Rank 0's numbers are broadcast, so every rank
    makes the same choices.
    """
    info = group_info(group)
    big = torch.ones(4 << 20)  # 16 MB
    other = torch.ones(4 << 20)
    gamma = _typical_time(lambda: big.add_(other), repeats) / big.nbytes
    mu = _typical_time(lambda: big.copy_(other), repeats) / big.nbytes
    values = dict(asdict(DEFAULT_PARAMS), gamma=gamma, mu=mu)
    if info.size > 1:
        p = info.size
        one, large = torch.zeros(1), torch.zeros(1 << 20)  # 4 B, 4 MB
        tree = _typical_time(lambda: api.all_reduce(one, algorithm="tree", group=group), repeats)
        values["alpha"] = tree / (2 * math.ceil(math.log2(p)))
        t_small = _typical_time(lambda: dist.all_reduce(one, group=group), repeats)
        values["alpha_native"] = t_small / (2 * (p - 1))
        t_large = _typical_time(lambda: dist.all_reduce(large, group=group), max(3, repeats // 3))
        moved = 2 * large.nbytes * (p - 1) / p
        reduced = large.nbytes * (p - 1) / p * gamma
        values["beta"] = max(2 * mu, (t_large - t_small - reduced) / moved)
        if api.same_host(group):
            shm = _typical_time(lambda: api.all_reduce(one, algorithm="shm", group=group), repeats)
            values["sigma"] = shm / 2
    names = ("alpha", "beta", "gamma", "mu", "sigma", "alpha_native")
    shared = torch.tensor([float(values[k]) for k in names], dtype=torch.float64)
    dist.broadcast(shared, info.global_rank(0), group=group)
    params = replace(DEFAULT_PARAMS, **dict(zip(names, shared.tolist())))
    set_params(info.key, params)
    return params
