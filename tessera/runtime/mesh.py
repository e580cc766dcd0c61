"""`Mesh`: the world arranged as a grid with named axes (dp, tp, pp), one process group per axis.

A rank's coordinates are `(pp, dp, tp)` with tp varying fastest: tensor-parallel peers, which talk
at every layer, are neighbouring ranks (the same machine when ranks are numbered per machine);
pipeline stages, which exchange one activation per micro-batch, are furthest apart. This is the
order of Megatron-LM and torchtitan. Built on `torch.distributed.device_mesh.init_device_mesh`,
which creates the sub-groups (a collective call: every rank builds the same mesh).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["AXES", "Mesh"]

AXES = ("pp", "dp", "tp")
"""Axis names, outermost first."""


class Mesh:
    """Named axes over the world, e.g. `Mesh(dp=2, tp=2)` on 4 ranks; dp*tp*pp must be the world."""

    def __init__(self, dp: int = 1, tp: int = 1, pp: int = 1, *, device_type: str | None = None):
        sizes = {"pp": pp, "dp": dp, "tp": tp}
        for axis, size in sizes.items():
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"mesh axis {axis} must be a positive int, got {size!r}")
        world = dist.get_world_size() if dist.is_initialized() else 1
        if dp * tp * pp != world:
            raise ValueError(
                f"mesh dp={dp} x tp={tp} x pp={pp} = {dp * tp * pp} ranks, the world has {world}"
            )
        if not dist.is_initialized():
            raise RuntimeError("Mesh needs a process group: call tessera.init() first")
        if device_type is None:
            device_type = (
                "cuda" if dist.get_backend() == "nccl" and torch.cuda.is_available() else "cpu"
            )
        self.sizes = sizes
        self.device_mesh: DeviceMesh = init_device_mesh(
            device_type, (pp, dp, tp), mesh_dim_names=AXES
        )

    def _check(self, axis: str) -> str:
        if axis not in AXES:
            raise ValueError(f"unknown mesh axis {axis!r}; the axes are {AXES}")
        return axis

    def group(self, axis: str) -> dist.ProcessGroup:
        """The process group of this rank's peers along `axis` (the others fixed)."""
        return self.device_mesh.get_group(self._check(axis))

    def rank(self, axis: str) -> int:
        """This rank's coordinate along `axis`."""
        return self.device_mesh.get_local_rank(self._check(axis))

    def size(self, axis: str) -> int:
        """Number of ranks along `axis`."""
        return self.sizes[self._check(axis)]

    def __repr__(self) -> str:
        coords = ", ".join(f"{a}={self.rank(a)}/{self.sizes[a]}" for a in AXES)
        return f"Mesh({coords})"
