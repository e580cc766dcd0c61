"""Gradient-norm clipping when the gradients are spread over ranks: one implementation for all.

`torch.nn.utils.clip_grad_norm_` sees only this process's tensors. Under ZeRO each rank holds a
slice of every averaged gradient, under pipeline parallelism each stage holds its own layers, under
tensor parallelism each rank a shard of some weights: the global norm is then
sqrt(sum over ranks of each rank's squared sum), with every element counted exactly once (the
caller decides what its rank contributes). The scaling is torch's: gradients are multiplied by
min(1, max_norm / (norm + 1e-6)).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

__all__ = ["clip_grad_norm", "squared_sum", "sum_over"]

AllReduce = Callable[[torch.Tensor], torch.Tensor]
"""Sums a tensor over the ranks that share the norm; returns the sum (in place or not)."""


def squared_sum(
    tensors: Iterable[torch.Tensor | None], weights: Iterable[float] | None = None
) -> torch.Tensor:
    """sum_i w_i * ||t_i||^2 in float64 (None tensors skipped; weights default to 1).

    float64 so that the order in which ranks add their shares changes nothing that matters.
    """
    total = torch.zeros((), dtype=torch.float64)
    pairs = zip(tensors, weights) if weights is not None else ((t, 1.0) for t in tensors)
    for tensor, weight in pairs:
        if tensor is not None and weight:
            total += weight * tensor.detach().double().square().sum()
    return total


def sum_over(group: dist.ProcessGroup | None) -> AllReduce:
    """An `AllReduce` over `group` with torch.distributed (None: the default group)."""

    def reduce(tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, group=group)
        return tensor

    return reduce


@torch.no_grad()
def clip_grad_norm(
    grads: Iterable[torch.Tensor | None],
    max_norm: float,
    *,
    local_sq_sum: torch.Tensor | None = None,
    all_reduce: AllReduce | None = None,
) -> float:
    """Scale `grads` in place so that the global norm is at most `max_norm`; return the norm.

    `local_sq_sum`: this rank's share of the squared global norm (default: `squared_sum(grads)`,
    right when the ranks hold disjoint parts). `all_reduce` sums the shares over the ranks
    (None: this process holds the whole gradient). Every rank of the reduction must call this.
    """
    grads = [g for g in grads if g is not None]
    share = squared_sum(grads) if local_sq_sum is None else local_sq_sum
    total = share.detach().to(torch.float64).reshape(1).clone()
    if all_reduce is not None:
        total = all_reduce(total)
    norm = math.sqrt(float(total.reshape(())))
    coefficient = min(1.0, max_norm / (norm + 1e-6))
    if coefficient < 1.0:
        for grad in grads:
            grad.mul_(coefficient)
    return norm
