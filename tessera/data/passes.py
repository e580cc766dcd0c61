"""One pass over a finite evaluation set, split over the ranks: every item once, none twice.

The `N` items, in order, are cut into `B` consecutive chunks of as equal sizes as can be (they
differ by at most one), and each chunk into `W` consecutive rank shares (again within one of
each other). `B` is the number of global batches of `G` items a pass needs, `ceil(N / G)`, but
never more than `N // W`, so that every share holds at least one item: evaluation steps can be
collective (ZeRO-3 gathers parameters, tensor and pipeline engines gather the batch), so every
rank must take every chunk, and an empty share would have to be padded with items that then
count twice. Here nothing is padded: the shares of the ranks together are the set, once.

The mean over the set is then `sum(loss_of_share * rows_of_share) / N` summed over chunks and
ranks, whether a rank's loss is its share's (data parallel) or the whole chunk's (engines that
gather the batch: each rank's weight is its share of the chunk's rows, so the chunk's loss counts
with the chunk's rows).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from tessera.data.order import ItemKey, SeededItems

__all__ = ["chunk_shares", "eval_loader"]


def _cuts(total: int, parts: int) -> list[int]:
    """`parts + 1` boundaries cutting `range(total)` into parts of sizes within one."""
    size, extra = divmod(total, parts)
    bounds, at = [0], 0
    for part in range(parts):
        at += size + (part < extra)
        bounds.append(at)
    return bounds


def chunk_shares(num_items: int, global_batch_size: int, rank: int, world: int) -> list[range]:
    """Rank `rank`'s item indices in each chunk of one pass (see the module docstring)."""
    if num_items < world:
        raise ValueError(
            f"the evaluation set has {num_items} items, fewer than the {world} ranks that "
            "split it (every rank evaluates at least one)"
        )
    chunks = min(-(-num_items // global_batch_size), num_items // world)
    bounds = _cuts(num_items, chunks)
    shares = []
    for first, end in zip(bounds, bounds[1:]):
        inner = _cuts(end - first, world)
        shares.append(range(first + inner[rank], first + inner[rank + 1]))
    return shares


class _PassSampler(torch.utils.data.Sampler):
    def __init__(self, shares: list[range]) -> None:
        self.shares = shares

    def __iter__(self) -> Iterator[list[ItemKey]]:
        for share in self.shares:
            yield [(0, index, index) for index in share]  # each item under its own seed

    def __len__(self) -> int:
        return len(self.shares)


def eval_loader(
    dataset: Any,
    shape: Any,
    *,
    global_batch_size: int,
    seed: int,
    rank: int,
    world_size: int,
    num_workers: int,
    pin_memory: bool,
) -> Iterable[Any]:
    """Rank `rank`'s batches of one pass over `dataset` (`chunk_shares`), collated by `shape`.

    Why so many parameters: as `tessera.data.loader.step_loader`, whose loader this is for
    the evaluation set.
    """
    shares = chunk_shares(len(dataset), global_batch_size, rank, world_size)
    return torch.utils.data.DataLoader(
        SeededItems(dataset, seed),
        batch_sampler=_PassSampler(shares),
        collate_fn=shape,
        num_workers=num_workers,
        pin_memory=pin_memory,
        generator=torch.Generator().manual_seed(seed),
    )
