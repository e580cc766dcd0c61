"""The shard layout of a ZeRO optimizer: per gradient bucket, one flat buffer, this rank's slice of
it, the master slice the inner optimizer steps, and the reduced gradient slice.

`ZeroOptimizer` (`tessera.zero.optimizer`) builds one `ShardLayout` and hands it, not itself, to
the parts that work on the shards: where the masters live (`tessera.zero.masters`) makes each
flat with `make_flat` and steps the masters on `step_gradient`; the delayed update
(`tessera.zero.delayed`) copies those gradients for its background step. Those parts therefore
depend on this module, never on the optimizer: the layout is their whole view of a stage.

What differs per stage is the layout's as well: stage 1 on one host reads its gradient slice
from the all-reduced bucket buffer (`gradient_slice`), and stage 3 keeps a compute-dtype shard
per flat and frees the flat buffer (`tessera.zero.stage3_layout.Stage3Layout`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tessera.data_parallel.bucket import Bucket
from tessera.optim.cpu_adam import host_zeros
from tessera.zero.host_link import HostLink
from tessera.zero.partition import FlatLayout, padded_numel, shard_range

__all__ = ["FlatShard", "ShardLayout"]


@dataclass
class FlatShard:
    """One bucket's parameters: the flat buffer, this rank's slice, its master and gradient."""

    bucket: Bucket
    layout: FlatLayout
    flat_param: torch.Tensor
    """(padded,) in the compute dtype; the module's parameters are views of it."""
    lo: int
    hi: int
    master: nn.Parameter
    """(hi - lo,) the slice the inner optimizer updates (fp32 under mixed precision)."""
    grad_shard: torch.Tensor | None = None
    """(hi - lo,) the reduced gradient slice, for stages that free the full gradient."""


class ShardLayout:
    """The flats of one ZeRO optimizer (stages 1 and 2; stage 3 adds its shards).

    `master_copied`: the master is never a view of the flat buffer (mixed precision, a delayed
    update whose step writes the master while forward reads the buffer, offload where it lives
    on the host, stage 3 whose buffer is freed). `release_gradients`: the stage frees each
    bucket's full gradient, so a flat keeps its own gradient slice. `huge_pages`: the buffers
    the inner optimizer steps go on transparent huge pages (`offload="cpu"`, see `host_zeros`).
    """

    def __init__(
        self,
        world: int,
        rank: int,
        *,
        link: HostLink | None,
        huge_pages: bool,
        release_gradients: bool,
        master_copied: bool,
    ) -> None:
        self.world = world
        self.rank = rank
        self.link = link
        """Offload: the host tensors the step reads and writes, copied to and from the device."""
        self.huge_pages = huge_pages
        self.release_gradients = release_gradients
        self.master_copied = master_copied
        self.flats: list[FlatShard] = []
        """One per gradient bucket, in bucket order (`make_flat` appends)."""

    def zeros(
        self, numel: int, dtype: torch.dtype, device: torch.device, *, stepped: bool
    ) -> torch.Tensor:
        """A zero buffer; on huge pages if the inner optimizer steps it (`stepped`: a master or
        a gradient it reads, kept from step to step) and `huge_pages` is on. Buffers freed
        every step (stage 2/3 full gradients) stay on torch's allocator."""
        if stepped and self.huge_pages and torch.device(device).type == "cpu":
            return host_zeros((numel,), dtype)
        return torch.zeros(numel, dtype=dtype, device=device)

    def make_flat(
        self,
        bucket: Bucket,
        sources: dict[int, torch.Tensor],
        master: nn.Parameter | None = None,
        write: Callable[[nn.Parameter, torch.Tensor], None] | None = None,
    ) -> FlatShard:
        """Lay out a bucket's parameters in a flat buffer, make this rank's master slice, and
        append the flat to `flats`. `sources` maps each parameter's id to its value (popped).

        `master`: a storageless master whose value goes to `write(master, value)` (the file of
        `offload="nvme"`); its step publishes into `publish_target` (under offload a staging
        buffer of the host link)."""
        layout = FlatLayout(tuple(bucket.names), tuple(tuple(p.shape) for p in bucket.params))
        padded = padded_numel(layout.numel, self.world)
        lo, hi = shard_range(layout.numel, self.world, self.rank)
        first = bucket.params[0]
        # Stages 1/2 in fp32 without DPU or offload: the master is a view of this buffer,
        # stepped in place.
        aliased = master is None and not self.master_copied
        flat_param = self.zeros(padded, first.dtype, first.device, stepped=aliased)
        master_full = None
        if not aliased:
            master_full = torch.zeros(padded, dtype=torch.float32, device=first.device)
        for position, param in enumerate(bucket.params):
            start, end = bucket.offsets[position], bucket.offsets[position + 1]
            source = sources.pop(id(param)).reshape(-1)
            flat_param[start:end].copy_(source)
            if master_full is not None:
                master_full[start:end].copy_(source)
            param.data = flat_param[start:end].view_as(param)
            del source
        if master is not None:
            assert write is not None and master_full is not None, "a storageless master"
            write(master, master_full[lo:hi])
        elif aliased:
            master = nn.Parameter(flat_param[lo:hi])  # aliases the buffer: no second copy
        elif self.link is not None:
            master = nn.Parameter(self.link.host_zeros(hi - lo, torch.float32))
            master.detach().copy_(master_full[lo:hi])
        else:
            master = self.zeros(hi - lo, torch.float32, first.device, stepped=True)
            master = nn.Parameter(master.copy_(master_full[lo:hi]))
        grad_shard = None
        if self.release_gradients:  # not stepped under offload: the host's `link.grads` are
            grad_shard = self.zeros(hi - lo, first.dtype, first.device, stepped=self.link is None)
        if self.link is not None:
            converted, published = master.dtype != first.dtype, write is not None
            self.link.add_bucket(hi - lo, first.dtype, converted=converted, published=published)
        flat = FlatShard(bucket, layout, flat_param, lo, hi, master, grad_shard)
        self.flats.append(flat)
        return flat

    def gradient_slice(self, flat: FlatShard) -> torch.Tensor:
        """This rank's averaged gradient slice, in the compute dtype, on the device: the flat's
        own, or (stage 1 on one host, which all-reduces in place) its part of the bucket."""
        if flat.grad_shard is not None:
            return flat.grad_shard
        assert not self.release_gradients, "a stage that frees full gradients keeps a slice"
        return flat.bucket.buffer[flat.lo : flat.hi]

    def step_gradient(self, flat: FlatShard) -> torch.Tensor:
        """The gradient slice the step reads: `gradient_slice`, or under offload its host copy."""
        if self.link is None:
            return self.gradient_slice(flat)
        return self.link.gradient(flat.bucket.index, lambda: self.gradient_slice(flat))

    def publish_target(self, flat: FlatShard) -> torch.Tensor | None:
        """Where a swapped master's new value goes in the step: the flat buffer's slice, in the
        compute dtype, or under offload the host link's staging buffer (stage 3 overrides)."""
        if self.link is not None:
            return self.link.staging[flat.bucket.index]
        return flat.flat_param[flat.lo : flat.hi]

    def visible_slice(self, flat: FlatShard) -> torch.Tensor:
        """This rank's slice of `flat` as forward sees it (stages 1/2: of the flat buffer)."""
        return flat.flat_param[flat.lo : flat.hi].detach()

    def parameter_shards(self) -> list[torch.Tensor]:
        """Parameter storage besides the flat buffers (stage 3's compute-dtype shards)."""
        return []
