"""`DataParallel`: tessera's own DDP, the algorithm of the PyTorch DDP paper in readable Python.

Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training" (VLDB 2020):
1. at construction, check that every rank built the same model, then broadcast rank 0's
   parameters and buffers, so all replicas start equal;
2. group gradients into buckets in reverse parameter order (`bucket.py`);
3. during backward, all-reduce each bucket as soon as its last gradient arrives, overlapping
   communication with the rest of backward (`reducer.py`); the end of backward waits for the rest;
4. buffers (BatchNorm's running statistics) are broadcast from rank 0 before each forward.

Cost per step for n gradient bytes on p ranks with a ring all-reduce: 2(p-1)/p * n bytes sent per
rank in about n / bucket_bytes collectives, most of it hidden behind backward when the model's
compute per bucket exceeds the bucket's reduction time.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten

from tessera import comm
from tessera.comm.flat import flatten, unflatten_into
from tessera.comm.stream import stream_for
from tessera.data_parallel.bucket import Bucket
from tessera.data_parallel.compression import CompressionHook, cast_hook, resolve_compression
from tessera.data_parallel.policy import DDPPolicy
from tessera.data_parallel.reducer import Reducer
from tessera.runtime.context import default_timeout_s

__all__ = ["DataParallel", "broadcast_from_first"]


@torch.no_grad()
def broadcast_from_first(tensors: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Copy group rank 0's values into `tensors`, one flat message per dtype (DDP's start and
    its buffers before each forward; ZeRO's start)."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for same in by_dtype.values():
        flat = flatten(same)
        comm.broadcast(flat, src, group=group)
        unflatten_into(flat, same)


def _reachable_parameters(outputs: Any) -> set[int]:
    """Ids of the leaf tensors the autograd graph of `outputs` can send a gradient to."""
    tensors = [t for t in tree_flatten(outputs)[0] if isinstance(t, torch.Tensor)]
    stack = [t.grad_fn for t in tensors if t.grad_fn is not None]
    reached = {id(t) for t in tensors if t.requires_grad and t.grad_fn is None}
    seen: set[Any] = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf
        if variable is not None:
            reached.add(id(variable))
        stack.extend(next_node for next_node, _ in node.next_functions if next_node is not None)
    return reached


class DataParallel(nn.Module):
    """Data-parallel wrapper: after `loss.backward()`, every `.grad` is the average over ranks.

    The wrapped module's own parameters are trained (no copy): build the optimizer on
    `module.parameters()`. Each rank feeds its own slice of the batch. Waiting for the gradient
    reduction is bounded by `timeout_s` (None: this rank's `Context.timeout_s`).

    Why so many parameters: they are torch's `DistributedDataParallel` knobs under its names
    (bucket size, unused parameters, buffers, the group, a communication hook), plus tessera's
    own algorithm choice and bound; keyword-only, each with the default DDP users expect.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        bucket_cap_mb: float = DDPPolicy.bucket_cap_mb,
        algorithm: str = "auto",
        compression: str | CompressionHook | None = None,
        find_unused_parameters: bool = False,
        group: dist.ProcessGroup | None = None,
        broadcast_buffers: bool = True,
        powersgd_rank: int = 2,
        check_finite: bool = False,
        timeout_s: float | None = None,
    ) -> None:
        super().__init__()
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        if algorithm != "auto" and algorithm not in comm.ALGORITHMS:
            raise ValueError(
                f"unknown algorithm {algorithm!r}; use 'auto' or one of {comm.ALGORITHMS}"
            )
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the module has no trainable parameters: nothing to make parallel")
        if not dist.is_initialized():
            raise RuntimeError("DataParallel needs a process group: call tessera.init() first")
        self.module = module
        self.group = group
        self.algorithm = algorithm
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self.check_finite = check_finite
        self._compression = resolve_compression(compression, powersgd_rank)
        self._world = dist.get_world_size(group)
        self._rank = dist.get_rank()
        # Every collective of this wrapper runs on the group's one stream, in program order,
        # behind whatever other engines on the group queued before (`tessera.comm.stream`).
        stream = stream_for(group)
        stream.run(self._check_same_model, what="DataParallel model check")
        stream.run(self._broadcast, list(module.parameters()) + list(module.buffers()))
        self.reducer = Reducer(
            named,
            cap_bytes=int(bucket_cap_mb * 2**20),
            reduce_bucket=self._reduce_bucket,
            rank=self._rank,
            timeout_s=default_timeout_s() if timeout_s is None else timeout_s,
            allocate=self._shared_allocator(named),
            group=group,
            engine_kind="DataParallel",
        )
        self.reducer.drop_unused_gradients = find_unused_parameters

    def reduce_in(self, dtype: torch.dtype) -> None:
        """Average every bucket in `dtype` from now on (mixed precision: half the bytes); the
        result is written back into the full-width gradients. Replaces no other compression.

        One rank communicates nothing, so its gradients keep their full width (a cast there
        would only round them, and cost two copies a bucket a step)."""
        if self._world == 1:
            return
        if self._compression is not None:
            raise ValueError("reduce_in: this DataParallel already compresses its gradients")
        self._compression = cast_hook(dtype)

    def _shared_allocator(self, named: list[tuple[str, nn.Parameter]]) -> Any:
        """Bucket buffers inside the shared-memory segment, when the shm transport may run.

        Autograd then accumulates gradients straight into the segment, and the shm all-reduce
        skips its copy in and out (the benchmark's `shm_shared` column). Collective: every rank
        allocates the same buckets in the same order.
        """
        if self.algorithm not in ("auto", "shm") or self._compression is not None:
            return None
        if any(param.device.type != "cpu" for _, param in named):
            return None

        def allocate(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            make = functools.partial(comm.shared_buffer, numel, dtype, group=self.group)
            return stream_for(self.group).run(make, what="shared_buffer")

        return allocate

    def _check_same_model(self) -> None:
        """Every rank must hold the same parameter names, shapes and dtypes as group rank 0."""
        mine = [(n, tuple(t.shape), str(t.dtype)) for n, t in self.module.state_dict().items()]
        everyone: list[Any] = [None] * self._world
        dist.all_gather_object(everyone, mine, group=self.group)
        reference = everyone[0]
        for group_rank, theirs in enumerate(everyone[1:], start=1):
            if theirs == reference:
                continue
            for ours, other in zip(reference, theirs):
                if ours != other:
                    raise ValueError(
                        f"rank {self._rank}: models differ across ranks: group rank 0 has "
                        f"{ours[0]} {ours[1]} {ours[2]}, group rank {group_rank} has "
                        f"{other[0]} {other[1]} {other[2]}"
                    )
            raise ValueError(
                f"rank {self._rank}: models differ across ranks: group rank 0 has "
                f"{len(reference)} tensors, group rank {group_rank} has {len(theirs)}"
            )

    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        """Copy group rank 0's values into `tensors` (`broadcast_from_first`)."""
        broadcast_from_first(tensors, self.group)

    def _reduce_bucket(self, bucket: Bucket) -> None:
        """Average one bucket over the group (runs on the group's communication stream)."""

        def all_reduce_mean(tensor: torch.Tensor) -> torch.Tensor:
            return comm.all_reduce(tensor, "mean", algorithm=self.algorithm, group=self.group)

        if self._compression is None:
            all_reduce_mean(bucket.buffer)
        else:
            self._compression(bucket, all_reduce_mean)
        if self.check_finite and not torch.isfinite(bucket.buffer).all():
            bad = [
                name
                for position, name in enumerate(bucket.names)
                if not torch.isfinite(bucket.view(position)).all()
            ]
            raise FloatingPointError(f"rank {self._rank}: non-finite gradient in {bad}")

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the wrapped module, after syncing buffers; prepare this step's reduction."""
        if self.broadcast_buffers and self._world > 1:
            buffers = list(self.module.buffers())
            if buffers:
                self.reducer.stream.run(
                    self._broadcast, buffers, label=self.reducer.engine.label(), what="buffers"
                )
        outputs = self.module(*inputs, **kwargs)
        if self.reducer.sync_enabled and torch.is_grad_enabled():
            unused: list[nn.Parameter] = []
            if self.find_unused_parameters:
                reached = _reachable_parameters(outputs)
                unused = [p for _, p in self._trainable() if id(p) not in reached]
            self.reducer.prepare_for_backward(unused)
        return outputs

    def _trainable(self) -> Iterator[tuple[str, nn.Parameter]]:
        return ((n, p) for n, p in self.module.named_parameters() if p.requires_grad)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Skip gradient reduction inside the block; gradients accumulate locally.

        The first backward outside the block reduces the accumulated gradients.
        """
        return self.reducer.no_sync()

    @property
    def exposed_comm_s(self) -> float:
        """Seconds the last backward waited for communication compute did not hide."""
        return self.reducer.exposed_comm_s

    @property
    def buckets(self) -> list[Bucket]:
        """The gradient buckets, in launch order."""
        return self.reducer.buckets
