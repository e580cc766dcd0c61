"""Raw collectives of tensor parallelism: the one place tensor parallelism communicates.

The all-reduces of Megatron's f and g and the all-gathers of sequence and vocabulary shards go
through `tessera.comm` with the cost model's choice ("auto": the shared-memory transport when
the group is on one host, 2-7x gloo's bus bandwidth at the 1-16 MB these layers move; see
BENCHMARKS.md, comm). Every wait has this rank's bound (`Context.timeout_s`, the
collectives' default), and the bytes each
rank contributes are counted in `STATS` (benchmarks read it).

These collectives run on the main thread, inside forward and backward. If another engine keeps a
communication stream on the same group (`tessera.comm.stream`), they queue behind its work
instead of racing it; on a group no engine streams on they run inline, with no thread hop.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tessera import comm
from tessera.comm.stream import run_in_order

__all__ = ["STATS", "all_gather_dim", "all_reduce", "group_rank", "group_size"]

STATS = {"all_reduce_bytes": 0, "all_gather_bytes": 0, "calls": 0}
"""Bytes this rank contributed to tensor-parallel collectives since the process started."""


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
    if group_size(group) == 1:
        return tensor
    STATS["all_gather_bytes"] += tensor.numel() * tensor.element_size()
    STATS["calls"] += 1
    return run_in_order(group, _all_gather_along, tensor, group, dim)


def _all_gather_along(
    tensor: torch.Tensor, group: dist.ProcessGroup | None, dim: int
) -> torch.Tensor:
    if dim == 0 and tensor.dim() > 0:
        return comm.all_gather(tensor, group=group)  # rank-major along dim 0 already
    out = comm.all_gather(tensor.unsqueeze(0), group=group)  # (size, ...): one row per rank
    return torch.cat(out.unbind(0), dim=dim)
