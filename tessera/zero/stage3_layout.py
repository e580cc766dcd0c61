"""Stage 3's shard layout: each flat buffer freed once made, this rank's shard kept instead.

Stage 3 (`tessera.zero.stage3`) keeps, between uses of a unit, only this rank's slice of each
flat, in the compute dtype: the shard its gathers read. `Stage3Layout` makes those shards as the
flats are made (so set-up never holds the whole model twice), says where the step publishes a
swapped master (`publish_target`) and what forward sees (`visible_slice`). The shard is the fp32
master itself where nothing needs a copy (fp32, no delayed update, the master on the device or
the parameters offloaded with it), a host copy under `offload_params` with `offload="cpu"`, and
a device copy otherwise.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tessera.data_parallel.bucket import Bucket
from tessera.zero.host_link import HostLink
from tessera.zero.partition import padded_numel, shard_range
from tessera.zero.shards import FlatShard, ShardLayout

__all__ = ["Stage3Layout"]


class Stage3Layout(ShardLayout):
    """The flats of stage 3, each with its compute-dtype shard (`shards`, in bucket order).

    `shared_master`: no mixed precision and no delayed update, so the fp32 master may serve as
    the shard. `offload_params`: this rank's parameter partition lives off the device;
    `in_files`: it is the inner optimizer's file (`offload="nvme"`). `initial`: a meta-device
    model's first values, per bucket its names and this rank's slice (`tessera.zero.materialize`).

    Why so many parameters: the base's, plus the three facts that decide where a shard lives.
    """

    def __init__(
        self,
        world: int,
        rank: int,
        *,
        link: HostLink | None,
        huge_pages: bool,
        shared_master: bool,
        offload_params: bool,
        in_files: bool,
        initial: dict[int, tuple[list[str], torch.Tensor]] | None,
    ) -> None:
        super().__init__(
            world, rank, link=link, huge_pages=huge_pages, release_gradients=True,
            master_copied=True,  # the flat buffer is freed: the master cannot be its view
        )  # fmt: skip
        self.shared_master = shared_master
        self.offload_params = offload_params
        self.in_files = in_files
        self.initial = initial
        self.shards: list[torch.Tensor] = []
        """Per flat, this rank's slice in the compute dtype, as the gathers read it."""

    def make_flat(
        self,
        bucket: Bucket,
        sources: dict[int, torch.Tensor],
        master: nn.Parameter | None = None,
        write: Callable[[nn.Parameter, torch.Tensor], None] | None = None,
    ) -> FlatShard:
        """The base's flat, then this rank's shard kept and the full buffer freed at once (so
        set-up never holds the whole model twice)."""
        if self.initial is not None:
            sources = self._initial_sources(bucket)
        flat = super().make_flat(bucket, sources, master, write)
        # Under DPU the gathers read a copy: the background step writes the master meanwhile.
        # Under offload the master is on the host: the gathers read a device copy.
        same = self.shared_master
        if (same and (self.link is None or self.offload_params)) or self.in_files:
            # The fp32 master is the shard (in the optimizer's files under offload_params with
            # offload="nvme": the stage reads it, rounded to the compute dtype).
            self.shards.append(flat.master.detach())
        elif self.offload_params:  # offload="cpu": a host copy in the compute dtype
            assert self.link is not None, "offload_params goes with the host step"
            shard = self.link.host_zeros(flat.hi - flat.lo, flat.flat_param.dtype)
            self.shards.append(shard.copy_(flat.flat_param[flat.lo : flat.hi]))
        else:
            self.shards.append(flat.flat_param[flat.lo : flat.hi].clone())
        flat.flat_param.untyped_storage().resize_(0)
        return flat

    def _initial_sources(self, bucket: Bucket) -> dict[int, torch.Tensor]:
        """A meta-device model's values for `make_flat`: right in this rank's slice (all the
        stage keeps), zero elsewhere; one unit of memory, freed once the flat is made."""
        assert self.initial is not None
        names, part = self.initial.pop(bucket.index)
        if names != bucket.names:
            raise RuntimeError(f"ZeRO-3 bucket {bucket.index} holds {bucket.names}, not {names}")
        numel = bucket.offsets[-1]
        lo, hi = shard_range(numel, self.world, self.rank)
        flat = torch.zeros(padded_numel(numel, self.world), dtype=part.dtype, device=part.device)
        flat[lo:hi] = part
        return {
            id(param): flat[bucket.offsets[i] : bucket.offsets[i + 1]].view(param.shape)
            for i, param in enumerate(bucket.params)
        }

    def publish_target(self, flat: FlatShard) -> torch.Tensor | None:
        """The compute-dtype shard the step refreshes (under offload, its host staging buffer,
        copied up at publish); none when the shard is the master."""
        if self.in_files:
            return None
        if self.link is not None:
            return self.link.staging[flat.bucket.index]
        return self.shards[flat.bucket.index]

    def visible_slice(self, flat: FlatShard) -> torch.Tensor:
        """This rank's shard as the gathers read it (a copy of the master under DPU)."""
        return self.shards[flat.bucket.index].detach()

    def parameter_shards(self) -> list[torch.Tensor]:
        """The compute-dtype shards (parameter storage besides the freed flat buffers)."""
        return list(self.shards)
