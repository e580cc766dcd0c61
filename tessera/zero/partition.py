"""Pure partitioning shared by the three ZeRO stages: which rank owns which elements.

ZeRO (Rajbhandari et al., SC 2020) splits each model state evenly over the N_d data-parallel
ranks. tessera partitions per gradient bucket: a bucket's parameters are laid out one after the
other in a flat buffer (`bucket.py`), the buffer is padded with zeros to a multiple of the world
size, and rank r owns the r-th of N equal slices. So

* every rank holds exactly the same number of elements (bytes balanced to the element, for any
  parameter shapes and any world size, divisor of the parameter count or not);
* a reduce-scatter of the bucket's gradient buffer hands each rank precisely its slice
  (`comm.reduce_scatter` splits like `tensor_split`), and an all-gather of the slices rebuilds the
  buffer: the collectives need no index bookkeeping;
* a slice may cut a parameter in two; `shard_pieces` says which part of which parameter a rank
  holds, which is what checkpoints store so that they can be consolidated or resharded onto
  another world size.

Nothing here talks to other processes: the functions are tested without them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["FlatLayout", "Piece", "padded_numel", "shard_pieces", "shard_range"]


def padded_numel(numel: int, world_size: int) -> int:
    """`numel` rounded up to a multiple of `world_size` (the flat buffer's length)."""
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    return -(-numel // world_size) * world_size


def shard_range(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """`[lo, hi)` of the padded flat buffer that `rank` owns; every rank's has the same size."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    size = padded_numel(numel, world_size) // world_size
    return rank * size, (rank + 1) * size


@dataclass(frozen=True)
class Piece:
    """A contiguous run of one parameter's flattened elements held in one rank's shard."""

    name: str
    """The parameter's name in the module."""
    param_lo: int
    """First element, in the parameter's own flattened index space."""
    param_hi: int
    """One past the last element."""
    shard_lo: int
    """Where the run starts inside the rank's shard."""


@dataclass(frozen=True)
class FlatLayout:
    """Parameters laid out back to back in one flat buffer (one gradient bucket)."""

    names: tuple[str, ...]
    """Parameter names, in buffer order."""
    shapes: tuple[tuple[int, ...], ...]
    """Their shapes."""

    @property
    def offsets(self) -> list[int]:
        """Start of each parameter in the buffer, plus the total length at the end."""
        offsets = [0]
        for shape in self.shapes:
            numel = 1
            for dim in shape:
                numel *= dim
            offsets.append(offsets[-1] + numel)
        return offsets

    @property
    def numel(self) -> int:
        """Elements of all parameters (the unpadded length)."""
        return self.offsets[-1]


def shard_pieces(layout: FlatLayout, world_size: int, rank: int) -> list[Piece]:
    """The parts of each parameter that `rank`'s shard of `layout` holds, in shard order.

    The shard is `shard_range(layout.numel, world_size, rank)` of the flat buffer; the padding
    at the end of the last shards belongs to no parameter and yields no piece.
    """
    lo, hi = shard_range(layout.numel, world_size, rank)
    offsets = layout.offsets
    pieces = []
    for index, name in enumerate(layout.names):
        start, end = max(lo, offsets[index]), min(hi, offsets[index + 1])
        if start < end:
            pieces.append(Piece(name, start - offsets[index], end - offsets[index], start - lo))
    return pieces


def total_numel(layouts: Sequence[FlatLayout]) -> int:
    """Parameters of all layouts together (unpadded)."""
    return sum(layout.numel for layout in layouts)
