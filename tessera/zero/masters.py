"""Where ZeRO's fp32 master slices live: in memory, or in the inner optimizer's files.

`ZeroOptimizer` holds one of these two and calls it for everything that depends on where the
masters are: building the flats and the inner optimizer, the step, reading and replacing a
master, and the value the step leaves for publishing. Each works on the optimizer's
`ShardLayout` (`tessera.zero.shards`), which it receives at construction: the flats, their
gradient slices and where a step publishes, never the optimizer itself.

* `HeldMasters` (the default): each master is a tensor (a view of the flat buffer where stages
  1/2 train in fp32 without DPU or offload, a copy otherwise: under offload a host tensor, see
  `tessera.zero.host_link`); the inner optimizer steps it in place.
* `SwappedMasters` (`offload="nvme"`): the masters live in the files of an optimizer that keeps
  its parameters there (`NVMeAdam(swap_params=True)`). They have no storage in memory; the step
  streams them through the optimizer's buffers and publishes each updated chunk into the
  layout's `publish_target` (stages 1/2: the flat buffer's slice; stage 3: its shard; under
  offload: the host link's staging buffer).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tessera.data_parallel.bucket import Bucket
from tessera.optim.cpu_adam import CPUAdam
from tessera.zero.partition import shard_range
from tessera.zero.shards import FlatShard, ShardLayout

__all__ = ["HeldMasters", "SwappedMasters"]


class _Masters:
    """What both placements hold: the optimizer's layout, and the inner optimizer over the
    masters (set by `build`: over tensors in memory, or holding the masters' files)."""

    swapped: bool

    def __init__(self, layout: ShardLayout) -> None:
        self.layout = layout
        self.optimizer: Any = None


class HeldMasters(_Masters):
    """The fp32 masters are tensors in memory, stepped in place by the inner optimizer."""

    swapped = False

    def __init__(self, layout: ShardLayout) -> None:
        super().__init__(layout)
        self.widened: dict[int, torch.Tensor] = {}
        """Per bucket, the host buffer its low-precision gradient is widened into for the
        step (`_widened`), kept from step to step."""

    def build(
        self, buckets: list[Bucket], sources: dict[int, torch.Tensor], make_optimizer: Any
    ) -> Any:
        """The flats (each with its master), then the inner optimizer over the masters."""
        for bucket in buckets:
            self.layout.make_flat(bucket, sources)
        self.optimizer = make_optimizer([flat.master for flat in self.layout.flats])
        return self.optimizer  # (masters in bucket order)

    def step(self, after_each: Callable[[FlatShard], None] | None = None) -> None:
        """The inner optimizer's step on the masters, each with its gradient slice.

        `after_each(flat)`: called once `flat`'s master is updated, while the step goes on with
        the next one, where the inner optimizer can say so (CPUAdam); else not at all."""
        flats = self.layout.flats
        grads = {id(flat.master): self.layout.step_gradient(flat) for flat in flats}
        keywords = step_keywords(self.layout, self.optimizer, grads)  # CPUAdam's bf16 reads
        if after_each is not None and reads_bf16(self.optimizer):
            by_id = {id(flat.master): flat for flat in flats}
            order = [by_id[id(p)] for group in self.optimizer.param_groups for p in group["params"]]
            keywords["after_each"] = lambda position: after_each(order[position])
        for flat in flats:
            grad = grads[id(flat.master)]  # on the host under offload
            if grad.dtype == flat.master.dtype:
                flat.master.grad = grad
            elif not ("grads" in keywords and grad.dtype == torch.bfloat16):
                flat.master.grad = self._widened(flat, grad)
        self.optimizer.step(**keywords)
        for flat in flats:
            flat.master.grad = None

    def _widened(self, flat: FlatShard, grad: torch.Tensor) -> torch.Tensor:
        """`grad`, `flat`'s gradient slice (bf16/fp16), in its master's dtype, for the step.

        On the host it is copied into a buffer kept from step to step: a fresh tensor that size
        is a new memory mapping, page-faulted in (and zeroed by the kernel) on every step. For
        50M elements on 2 cores `grad.float()` took 96 ms against 14 ms for the same copy into
        a kept buffer, and the CPU Adam step itself 34 ms. On a device the caching allocator
        reuses the block, so a plain conversion costs no more than the copy."""
        if grad.device.type != "cpu":
            return grad.to(flat.master.dtype)
        buffer = self.widened.get(flat.bucket.index)
        if buffer is None or buffer.shape != grad.shape:
            link = self.layout.link
            numel, dtype = grad.numel(), flat.master.dtype
            buffer = (
                link.host_zeros(numel, dtype)
                if link is not None
                else grad.new_empty(numel, dtype=dtype)
            )
            buffer = buffer.view(grad.shape)
            self.widened[flat.bucket.index] = buffer
        return buffer.copy_(grad)

    def value(self, flat: FlatShard) -> torch.Tensor:
        """This rank's fp32 master slice of `flat`."""
        return flat.master.detach()

    def set(self, flat: FlatShard, value: torch.Tensor) -> None:
        """Replace this rank's master slice of `flat` (a checkpoint load)."""
        flat.master.copy_(value)
        if self.layout.link is not None:
            self.layout.link.forget_staged(flat.bucket.index)

    def published(self, flat: FlatShard) -> torch.Tensor:
        """The updated slice of `flat` the stage publishes after the step: the master itself."""
        return flat.master.detach()


class SwappedMasters(_Masters):
    """The fp32 masters live in the inner optimizer's files (`offload="nvme"`)."""

    swapped = True

    def build(
        self, buckets: list[Bucket], sources: dict[int, torch.Tensor], make_optimizer: Any
    ) -> Any:
        """The optimizer first: each master goes to its file as its flat is made."""
        masters = [_storageless_master(self.layout, bucket) for bucket in buckets]
        self.optimizer = make_optimizer(masters)
        if not getattr(self.optimizer, "swap_params", False):
            raise TypeError(
                f"swap_masters=True needs an optimizer that keeps its parameters in files "
                f"(NVMeAdam(swap_params=True)), got {type(self.optimizer).__name__}"
            )
        for bucket, master in zip(buckets, masters):
            self.layout.make_flat(bucket, sources, master, write=self.write)
        return self.optimizer

    def write(self, master: nn.Parameter, value: torch.Tensor) -> None:
        """Write a storageless master's value into its file."""
        self.optimizer.write_param(master, value)

    def step(self, after_each: Callable[[FlatShard], None] | None = None) -> None:
        """The streamed step: gradients in their own dtype, converted chunk by chunk, and each
        updated chunk published into the layout's target (`after_each` is not called: the
        publish sends every flat)."""
        layout = self.layout
        flats = {id(flat.master): flat for flat in layout.flats}
        ordered = [flats[id(master)] for master in self.optimizer.params]  # by optimizer group
        self.optimizer.step(
            grads=[layout.step_gradient(flat) for flat in ordered],  # the host copies, clipped
            publish=[layout.publish_target(flat) for flat in ordered],
        )

    def value(self, flat: FlatShard) -> torch.Tensor:
        """This rank's fp32 master slice of `flat`, read back from its file."""
        return self.optimizer.read_param(flat.master)

    def set(self, flat: FlatShard, value: torch.Tensor) -> None:
        """Replace this rank's master slice of `flat` in its file and in the layout's target."""
        self.optimizer.write_param(flat.master, value)
        target = self.layout.publish_target(flat)
        if target is not None:
            target.copy_(value)

    def published(self, flat: FlatShard) -> torch.Tensor:
        """The updated slice of `flat` the stage publishes after the step: the copy the step
        published into the layout's target (the flat buffer's slice, or a staging buffer)."""
        target = self.layout.publish_target(flat)
        assert target is not None, "a master whose shard is its file publishes nothing"
        return target.detach()


def reads_bf16(optimizer: Any) -> bool:
    """Does `optimizer`'s step read bfloat16 gradients and write bfloat16 copies (CPUAdam)?"""
    return isinstance(optimizer, CPUAdam)


def step_keywords(
    layout: ShardLayout, optimizer: Any, grads: dict[int, torch.Tensor]
) -> dict[str, list]:
    """What the inner optimizer's step takes besides the masters' `.grad`, where it is CPUAdam:

    * `grads`, where `grads` (id of master -> its gradient slice) holds bfloat16 slices: the
      kernel widens them as it reads them, so no float32 copy of the partition is made (2
      bytes read an element instead of 6 for the copy and 4 for the step); the masters'
      `.grad` stays None (torch refuses a bfloat16 `.grad` on a float32 master);
    * `bf16_out` (`HostLink.step_outputs`): each updated master rounded into its bucket's
      staging buffer in the same pass, the buckets marked staged for the upload that follows.

    Empty for any other optimizer: the masters' `.grad` (float32) is all it reads."""
    keywords: dict[str, list] = {}
    if not reads_bf16(optimizer):
        return keywords
    if any(grad.dtype == torch.bfloat16 for grad in grads.values()):
        low = [grads.get(id(p)) for group in optimizer.param_groups for p in group["params"]]
        keywords["grads"] = [
            g if g is not None and g.dtype == torch.bfloat16 else None for g in low
        ]
    if layout.link is not None:
        masters = {id(flat.master): flat.bucket.index for flat in layout.flats}
        fused = layout.link.step_outputs(masters, optimizer)
        if fused is not None:
            keywords["bf16_out"], staged = fused
            layout.link.staged(staged)
    return keywords


def _storageless_master(layout: ShardLayout, bucket: Bucket) -> nn.Parameter:
    """A master of the right length with no memory behind it (its value goes to a file)."""
    numel = sum(p.numel() for p in bucket.params)
    lo, hi = shard_range(numel, layout.world, layout.rank)
    master = torch.empty(hi - lo, dtype=torch.float32)  # the host's: NVMeAdam steps it there
    master.untyped_storage().resize_(0)
    return nn.Parameter(master)
