"""Gradient-norm clipping when the gradients are spread over ranks: one implementation for all.

`torch.nn.utils.clip_grad_norm_` sees only this process's tensors. Under ZeRO each rank holds a
slice of every averaged gradient, under pipeline parallelism each stage holds its own layers, under
tensor parallelism each rank a shard of some weights: the global norm is then
sqrt(sum over ranks of each rank's squared sum), with every element counted exactly once (the
caller decides what its rank contributes). The scaling is torch's: gradients are multiplied by
min(1, max_norm / (norm + 1e-6)).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from tessera.runtime.devices import collective_device
from tessera.runtime.scalar import DeviceScalar

__all__ = ["clip_grad_norm", "squared_sum", "sum_over"]

AllReduce = Callable[[torch.Tensor], torch.Tensor]
"""Sums a tensor over the ranks that share the norm; returns the sum (in place or not)."""


def squared_sum(
    tensors: Iterable[torch.Tensor | None], weights: Iterable[float] | None = None
) -> torch.Tensor:
    """sum_i w_i * ||t_i||^2 in float64 (None tensors skipped; weights default to 1).

    float64 so that the order in which ranks add their shares changes nothing that matters.
    Each device's tensors are added on that device, with no host sync (CUDA gradients stay on
    the GPU; a CPU accumulator beside them would be an error); the sum lives on the device of
    the first tensor (the CPU when there is none), each other device's part copied there once.
    The tensors of one device and weight take one `_foreach_norm` computed in float64 (no
    float64 copy of a gradient is made): a few operators a group, not four a tensor, which on a
    GPU are kernel launches (ZeRO clips its slices of every bucket each step).
    """
    pairs = zip(tensors, weights) if weights is not None else ((t, 1.0) for t in tensors)
    groups: dict[tuple[torch.device, float], list[torch.Tensor]] = {}
    for tensor, weight in pairs:
        if tensor is not None and weight:
            groups.setdefault((tensor.device, float(weight)), []).append(tensor.detach())
    per_device: dict[torch.device, torch.Tensor] = {}
    for (device, weight), members in groups.items():
        norms = torch._foreach_norm(members, 2.0, dtype=torch.float64)
        term = (norms[0] if len(norms) == 1 else torch.stack(norms)).square().sum()
        term = term if weight == 1.0 else term * weight
        before = per_device.get(device)
        per_device[device] = term if before is None else before + term
    if not per_device:
        return torch.zeros((), dtype=torch.float64)
    parts = iter(per_device.values())
    total = next(parts)
    for part in parts:
        total = total + part.to(total.device)
    return total


def sum_over(group: dist.ProcessGroup | None) -> AllReduce:
    """An `AllReduce` over `group` with torch.distributed (None: the default group)."""

    def reduce(tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, group=group)
        return tensor

    reduce.group = group  # type: ignore[attr-defined] - read by clip_grad_norm for the device
    return reduce


@torch.no_grad()
def clip_grad_norm(
    grads: Iterable[torch.Tensor | None],
    max_norm: float,
    *,
    local_sq_sum: torch.Tensor | None = None,
    all_reduce: AllReduce | None = None,
) -> DeviceScalar:
    """Scale `grads` in place so that the global norm is at most `max_norm`; return the norm.

    `local_sq_sum`: this rank's share of the squared global norm (default: `squared_sum(grads)`,
    right when the ranks hold disjoint parts). `all_reduce` sums the shares over the ranks
    (None: this process holds the whole gradient). Every rank of the reduction must call this.
    The norm and the scaling stay on the device (torch's clip_grad_norm_ does the same): the
    norm returned is a `DeviceScalar`, read by the host only when used (`float(norm)`).
    """
    grads = [g for g in grads if g is not None]
    share = squared_sum(grads) if local_sq_sum is None else local_sq_sum
    total = share.detach().to(torch.float64).reshape(1).clone()
    if all_reduce is not None:  # on the device the group reduces on (NCCL: this rank's GPU)
        total = all_reduce(total.to(collective_device(getattr(all_reduce, "group", None))))
    norm = total.reshape(()).sqrt()
    coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    _scale_in_place(grads, coefficient)
    return DeviceScalar(norm)


def _scale_in_place(grads: list[torch.Tensor], coefficient: torch.Tensor) -> None:
    """`grad *= coefficient` for each, one foreach kernel per (device, dtype) group."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for grad in grads:
        groups.setdefault((grad.device, grad.dtype), []).append(grad)
    for (device, _), members in groups.items():
        torch._foreach_mul_(members, coefficient.to(device))
