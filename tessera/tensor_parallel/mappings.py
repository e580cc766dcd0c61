"""Megatron's communication mappings as autograd Functions (Shoeybi et al. 2019, section 3).

Tiers (STYLE lesson 4): raw op (`_comm.py`) -> `autograd.Function` (here) -> public function taking
`group` (here) -> `nn.Module` (`layers.py`). A column-parallel layer followed by a row-parallel one
(an MLP, an attention block) communicates once forward (g) and once backward (f):

    x --f--> [column: Y_i = X A_i] -> act -> [row: Z_i = Y_i B_i] --g--> sum_i Z_i

f (`copy_to_tensor_parallel`): identity forward, all-reduce of the input gradient backward.
g (`reduce_from_tensor_parallel`): all-reduce forward, identity backward.
Each all-reduce moves `2 (t-1)/t * n` elements per rank with a ring (t ranks, n elements).
`gather_from_tensor_parallel` / `scatter_to_tensor_parallel` move between a split and a full
last dimension (a column layer whose output is needed whole; a row layer fed a full input).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tessera.tensor_parallel._comm import all_gather_dim, all_reduce, group_rank, group_size

__all__ = [
    "copy_to_tensor_parallel",
    "gather_from_tensor_parallel",
    "reduce_from_tensor_parallel",
    "scatter_to_tensor_parallel",
]


def _local_slice(x: torch.Tensor, group: dist.ProcessGroup | None, dim: int) -> torch.Tensor:
    size = group_size(group)
    if x.shape[dim] % size:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} does not split over {size} ranks")
    return x.chunk(size, dim=dim)[group_rank(group)].contiguous()


class _CopyToTensorParallel(torch.autograd.Function):
    """Megatron's f. Forward: identity (the input is already replicated on every rank).
    Backward: all-reduce (sum) the gradient, since every rank's partial computation used it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return all_reduce(grad.clone(), ctx.group), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's g. Forward: all-reduce (sum) the partial outputs of the ranks.
    Backward: identity (the sum's gradient reaches every partial output unchanged)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        return all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromTensorParallel(torch.autograd.Function):
    """Forward: all-gather the ranks' slices along `dim` into the full tensor.
    Backward: keep this rank's slice of the gradient (no communication)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None, dim: int
    ) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return all_gather_dim(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _local_slice(grad, ctx.group, ctx.dim), None, None


class _ScatterToTensorParallel(torch.autograd.Function):
    """Forward: keep this rank's slice along `dim` (no communication).
    Backward: all-gather the slices' gradients into the full gradient."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None, dim: int
    ) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _local_slice(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return all_gather_dim(grad, ctx.group, ctx.dim), None, None


def copy_to_tensor_parallel(
    x: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """f: identity forward, gradient all-reduce backward."""
    return _CopyToTensorParallel.apply(x, group) if group_size(group) > 1 else x


def reduce_from_tensor_parallel(
    x: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """g: all-reduce forward, identity backward."""
    return _ReduceFromTensorParallel.apply(x, group) if group_size(group) > 1 else x


def gather_from_tensor_parallel(
    x: torch.Tensor, group: dist.ProcessGroup | None = None, dim: int = -1
) -> torch.Tensor:
    """All-gather slices along `dim` forward; slice the gradient backward."""
    return _GatherFromTensorParallel.apply(x, group, dim) if group_size(group) > 1 else x


def scatter_to_tensor_parallel(
    x: torch.Tensor, group: dist.ProcessGroup | None = None, dim: int = -1
) -> torch.Tensor:
    """Slice along `dim` forward; all-gather the gradient backward."""
    return _ScatterToTensorParallel.apply(x, group, dim) if group_size(group) > 1 else x
