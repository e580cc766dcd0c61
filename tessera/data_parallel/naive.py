"""The naive versions, kept beside the fast ones: per-tensor averaging after backward.

`average_gradients` is data parallelism in five lines: after `loss.backward()`, all-reduce every
gradient on its own and divide by the world size. It is what `DataParallel` computes, minus the
buckets and the overlap, and the tests hold the fast version to it. `average_parameters` is the
same over the weights themselves: local SGD (periodic model averaging; Lin et al., "Don't Use
Large Mini-Batches, Use Local SGD", ICLR 2020) calls it every H steps instead of reducing
gradients every step, trading staleness for H times less communication.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tessera import comm
from tessera.comm.flat import flatten, unflatten_into

__all__ = ["average_gradients", "average_parameters"]


@torch.no_grad()
def average_gradients(
    module: nn.Module, *, algorithm: str = "auto", group: dist.ProcessGroup | None = None
) -> None:
    """Replace every `.grad` by its average over the group: one all-reduce per parameter."""
    world = dist.get_world_size(group)
    for param in module.parameters():
        if param.grad is not None:
            comm.all_reduce(param.grad, "sum", algorithm=algorithm, group=group)
            param.grad.div_(world)


@torch.no_grad()
def average_parameters(
    module: nn.Module, *, algorithm: str = "auto", group: dist.ProcessGroup | None = None
) -> None:
    """Replace every parameter by its average over the group, as one flat all-reduce."""
    params = [p for p in module.parameters()]
    if not params:
        return
    flat = flatten(params)
    comm.all_reduce(flat, "sum", algorithm=algorithm, group=group)
    flat.div_(dist.get_world_size(group))
    unflatten_into(flat, params)
