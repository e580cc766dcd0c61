"""Raw collectives of tensor parallelism: the one place tensor parallelism communicates.

The all-reduces of Megatron's f and g go through `tessera.comm.all_reduce` with the cost model's
choice ("auto": the shared-memory transport when the group is on one host, 2-7x gloo's bus
bandwidth at the 1-16 MB these layers move; see BENCHMARKS.md, comm). The all-gather stays on
`torch.distributed` (tessera's is ring only, slower than gloo's at these sizes). Every wait has
the job's deadline (TESSERA_TIMEOUT_S), and the bytes each rank contributes are counted in
`STATS` (benchmarks read it).

These collectives run on the main thread, inside forward and backward. If another engine keeps a
communication stream on the same group (`tessera.comm.stream`), they queue behind its work
instead of racing it; on a group no engine streams on they run inline, with no thread hop.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from tessera import comm
from tessera.comm.stream import run_in_order
from tessera.runtime.context import default_timeout_s

__all__ = ["STATS", "all_gather_dim", "all_reduce", "group_rank", "group_size"]

# torch 2.13 renamed all_gather_into_tensor to all_gather_single; older torch has only the first.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

STATS = {"all_reduce_bytes": 0, "all_gather_bytes": 0, "calls": 0}
"""Bytes this rank contributed to tensor-parallel collectives since the process started."""


def _timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=default_timeout_s())


def group_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in `group` (1 without a process group: a world of one)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This rank's index in `group`."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def all_reduce(
    tensor: torch.Tensor, group: dist.ProcessGroup | None, op: str = "sum"
) -> torch.Tensor:
    """Reduce `tensor` in place over `group` (sum or max) and return it."""
    if group_size(group) == 1:
        return tensor
    STATS["all_reduce_bytes"] += tensor.numel() * tensor.element_size()
    STATS["calls"] += 1
    return run_in_order(group, _all_reduce, tensor, op, group)


def _all_reduce(tensor: torch.Tensor, op: str, group: dist.ProcessGroup | None) -> torch.Tensor:
    return comm.all_reduce(tensor, op, group=group)


def all_gather_dim(tensor: torch.Tensor, group: dist.ProcessGroup | None, dim: int) -> torch.Tensor:
    """Concatenate every rank's `tensor` (equal shapes) along `dim`, in rank order."""
    size = group_size(group)
    if size == 1:
        return tensor
    STATS["all_gather_bytes"] += tensor.numel() * tensor.element_size()
    STATS["calls"] += 1
    return run_in_order(group, _all_gather_rows, tensor, group, size, dim)


def _all_gather_rows(
    tensor: torch.Tensor, group: dist.ProcessGroup | None, size: int, dim: int
) -> torch.Tensor:
    tensor = tensor.contiguous().unsqueeze(0)  # (1, ...): gloo gathers along dim 0
    out = torch.empty((size, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    work = _all_gather_single(out, tensor, group=group, async_op=True)
    work.wait(timeout=_timeout())
    return torch.cat(out.unbind(0), dim=dim)
