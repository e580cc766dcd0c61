"""Where ZeRO's fp32 master slices live: in memory, or in the inner optimizer's files.

`ZeroOptimizer` holds one of these two and calls it for everything that depends on where the
masters are: building the flats and the inner optimizer, the step, reading and replacing a
master, and the slice stages 1/2 all-gather after the step.

* `HeldMasters` (the default): each master is a tensor (a view of the flat buffer where stages
  1/2 train in fp32 without DPU or offload, a copy otherwise: under offload a host tensor, see
  `tessera.zero.host_link`); the inner optimizer steps it in place.
* `SwappedMasters` (`offload="nvme"`): the masters live in the files of an optimizer that keeps
  its parameters there (`NVMeAdam(swap_params=True)`). They have no storage in memory; the step
  streams them through the optimizer's buffers and publishes each updated chunk into the
  stage's `_publish_target` (stages 1/2: the flat buffer's slice; stage 3: its shard).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tessera.data_parallel.bucket import Bucket
from tessera.zero.partition import shard_range

if TYPE_CHECKING:
    from tessera.zero.optimizer import FlatShard, ZeroOptimizer

__all__ = ["HeldMasters", "SwappedMasters"]


class HeldMasters:
    """The fp32 masters are tensors in memory, stepped in place by the inner optimizer."""

    swapped = False

    def build(
        self, zero: ZeroOptimizer, sources: dict[int, torch.Tensor], make_optimizer: Any
    ) -> tuple[list[FlatShard], Any]:
        """The flats (each with its master), then the inner optimizer over the masters."""
        flats = [zero._make_flat(bucket, sources) for bucket in zero.reducer.buckets]
        return flats, make_optimizer([flat.master for flat in flats])  # masters in bucket order

    def step(self, zero: ZeroOptimizer) -> None:
        """The inner optimizer's step on the masters, each with its gradient slice."""
        for flat in zero.flats:
            grad = zero.step_gradient(flat)  # on the host under offload
            flat.master.grad = grad if grad.dtype == flat.master.dtype else grad.float()
        zero.optimizer.step()
        for flat in zero.flats:
            flat.master.grad = None

    def value(self, zero: ZeroOptimizer, flat: FlatShard) -> torch.Tensor:
        """This rank's fp32 master slice of `flat`."""
        return flat.master.detach()

    def set(self, zero: ZeroOptimizer, flat: FlatShard, value: torch.Tensor) -> None:
        """Replace this rank's master slice of `flat` (a checkpoint load)."""
        flat.master.copy_(value)

    def publish_source(self, flat: FlatShard) -> torch.Tensor:
        """The slice stages 1/2 all-gather after the step: the master itself."""
        return flat.master.detach()


class SwappedMasters:
    """The fp32 masters live in the inner optimizer's files (`offload="nvme"`)."""

    swapped = True

    def __init__(self) -> None:
        self.optimizer: Any = None
        """The inner optimizer that holds the masters' files (set by `build`)."""

    def build(
        self, zero: ZeroOptimizer, sources: dict[int, torch.Tensor], make_optimizer: Any
    ) -> tuple[list[FlatShard], Any]:
        """The optimizer first: each master goes to its file as its flat is made."""
        masters = [_storageless_master(zero, bucket) for bucket in zero.reducer.buckets]
        self.optimizer = make_optimizer(masters)
        if not getattr(self.optimizer, "swap_params", False):
            raise TypeError(
                f"swap_masters=True needs an optimizer that keeps its parameters in files "
                f"(NVMeAdam(swap_params=True)), got {type(self.optimizer).__name__}"
            )
        flats = [
            zero._make_flat(bucket, sources, master)
            for bucket, master in zip(zero.reducer.buckets, masters)
        ]
        return flats, self.optimizer

    def write(self, master: nn.Parameter, value: torch.Tensor) -> None:
        """Write a storageless master's value into its file."""
        self.optimizer.write_param(master, value)

    def step(self, zero: ZeroOptimizer) -> None:
        """The streamed step: gradients in their own dtype, converted chunk by chunk, and each
        updated chunk published into the stage's target."""
        flats = {id(flat.master): flat for flat in zero.flats}
        ordered = [flats[id(master)] for master in zero.optimizer.params]  # by optimizer group
        zero.optimizer.step(
            grads=[zero.step_gradient(flat) for flat in ordered],  # the host copies, clipped
            publish=[zero._publish_target(flat) for flat in ordered],
        )

    def value(self, zero: ZeroOptimizer, flat: FlatShard) -> torch.Tensor:
        """This rank's fp32 master slice of `flat`, read back from its file."""
        return zero.optimizer.read_param(flat.master)

    def set(self, zero: ZeroOptimizer, flat: FlatShard, value: torch.Tensor) -> None:
        """Replace this rank's master slice of `flat` in its file and in the stage's target."""
        zero.optimizer.write_param(flat.master, value)
        target = zero._publish_target(flat)
        if target is not None:
            target.copy_(value)

    def publish_source(self, flat: FlatShard) -> torch.Tensor:
        """The slice stages 1/2 all-gather after the step: the copy the step published."""
        return flat.flat_param[flat.lo : flat.hi].detach()


def _storageless_master(zero: ZeroOptimizer, bucket: Bucket) -> nn.Parameter:
    """A master of the right length with no memory behind it (its value goes to a file)."""
    numel = sum(p.numel() for p in bucket.params)
    lo, hi = shard_range(numel, zero.world, zero.rank)
    master = torch.empty(hi - lo, dtype=torch.float32)  # the host's: NVMeAdam steps it there
    master.untyped_storage().resize_(0)
    return nn.Parameter(master)
