"""Partition a model's parameters over S servers by bytes; a large tensor may be split.

All parameters, flattened in `named_parameters()` order, form one virtual byte buffer; server `s`
owns bytes `[s*B/S, (s+1)*B/S)`, rounded to element boundaries. Every server holds the same number
of bytes (within one element) whatever the tensor sizes, so pushes and pulls, which go to all
shards in parallel, take about the same time on each. A tensor crossing a boundary is split into
contiguous pieces of its flattened view; element-wise optimizers (SGD, Adam) update a piece exactly
as they would update it inside the whole tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tessera.errors import ConfigError

__all__ = ["Piece", "ShardPlan", "plan_shards"]


@dataclass(frozen=True)
class Piece:
    """Elements `[start, stop)` of the flattened parameter `name` (index `param_index`)."""

    name: str
    param_index: int
    start: int
    stop: int

    @property
    def numel(self) -> int:
        """Number of elements in the piece."""
        return self.stop - self.start


@dataclass(frozen=True)
class ShardPlan:
    """Which pieces each server owns; identical on every process built from the same model."""

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    shards: tuple[tuple[Piece, ...], ...]
    """`shards[s]`: the pieces of server `s`, in parameter order."""

    @property
    def num_servers(self) -> int:
        """S."""
        return len(self.shards)

    def gather(self, server: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Server `server`'s pieces cut from full tensors (parameters or gradients), as copies;
        each knows its whole tensor's number of dims (`source_ndim`): an optimizer factory that
        groups by shape (weight decay on matrices only) groups a piece as its parameter."""
        pieces = []
        for p in self.shards[server]:
            whole = tensors[p.param_index]
            piece = whole.detach().reshape(-1)[p.start : p.stop].clone()
            piece.source_ndim = whole.dim()  # type: ignore[attr-defined]
            pieces.append(piece)
        return pieces

    def scatter(self, server: int, pieces: list[torch.Tensor], into: list[torch.Tensor]) -> None:
        """Write server `server`'s pieces into the full tensors `into`, in place."""
        with torch.no_grad():
            for piece, value in zip(self.shards[server], pieces, strict=True):
                into[piece.param_index].view(-1)[piece.start : piece.stop].copy_(value)

    def assemble(self, pieces_per_server: list[list[torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Full tensors, by name, from every server's pieces (the final state dict)."""
        flat: list[torch.Tensor | None] = [None] * len(self.names)
        for server, pieces in enumerate(pieces_per_server):
            for piece, value in zip(self.shards[server], pieces, strict=True):
                if flat[piece.param_index] is None:
                    numel = self.shapes[piece.param_index].numel()
                    flat[piece.param_index] = torch.empty(numel, dtype=value.dtype)
                flat[piece.param_index][piece.start : piece.stop] = value
        return {n: t.view(s) for n, t, s in zip(self.names, flat, self.shapes, strict=True)}


def _split_points(sizes_bytes: list[int], num_servers: int) -> list[int]:
    total = sum(sizes_bytes)
    return [round(s * total / num_servers) for s in range(num_servers + 1)]


def plan_shards(model: nn.Module, num_servers: int) -> ShardPlan:
    """Cut `model`'s parameters into `num_servers` contiguous byte ranges of equal size."""
    named = [(n, p) for n, p in model.named_parameters()]
    if num_servers < 1:
        raise ConfigError(f"num_servers must be at least 1, got {num_servers}")
    if not named:
        raise ConfigError("the model has no parameters to serve")
    total_numel = sum(p.numel() for _, p in named)
    if num_servers > total_numel:
        raise ConfigError(
            f"num_servers={num_servers} exceeds the model's {total_numel} parameter elements: "
            "a server would own nothing"
        )
    sizes = [p.numel() * p.element_size() for _, p in named]
    bounds = _split_points(sizes, num_servers)
    shards: list[list[Piece]] = [[] for _ in range(num_servers)]
    offset = 0  # byte offset of the current parameter in the virtual buffer
    for index, ((name, param), size) in enumerate(zip(named, sizes, strict=True)):
        element = param.element_size()
        for server in range(num_servers):
            lo, hi = max(bounds[server], offset), min(bounds[server + 1], offset + size)
            # Round both ends the same way, so neighbouring pieces meet exactly.
            start = min(param.numel(), round((lo - offset) / element))
            stop = min(param.numel(), round((hi - offset) / element))
            if hi > lo and stop > start:
                shards[server].append(Piece(name, index, start, stop))
        offset += size
    if any(not shard for shard in shards):  # rounding left a server empty (tiny models)
        raise ConfigError(
            f"num_servers={num_servers} is too many for a model of "
            f"{total_numel} elements: a server would own nothing"
        )
    return ShardPlan(
        names=tuple(n for n, _ in named),
        shapes=tuple(p.shape for _, p in named),
        shards=tuple(tuple(s) for s in shards),
    )
