"""The order of a map-style data set's items: epochs of a seeded permutation, cut into steps.

Epoch `e` is one permutation of the `N` items drawn by a generator seeded from `(seed, e)`; it is
cut into `N // G` global batches of `G` items (the `N % G` left over are dropped, a different few
each epoch, as `DataLoader(drop_last=True)` does), so step `s` belongs to epoch `s // (N // G)`
and its batch is a pure function of `(seed, s)`: a resumed run, any number of loader workers and
any world size draw the batches an uninterrupted run would. Rank r keeps rows `[r*b, (r+1)*b)`
of each global batch (`b = G // world`), as `tessera.data.sharding` cuts the demo corpus.

The permutation is computed once per epoch and kept (not once per step: `randperm` of 50M items
takes over a second).

Each item is fetched under its own random seed, derived from `(seed, step, position in the
global batch)` (`seeded`): random augmentation in `__getitem__` draws the same numbers whichever
worker or rank fetches the item and whether the run was resumed, and the training process's own
random streams are left as they were.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from typing import Any

import torch

from tessera.data.sharding import _generator, local_batch_size

__all__ = ["EpochOrder", "ItemKey", "SeededItems", "StepSampler", "item_seed"]

ItemKey = tuple[int, int, int]
"""`(step, position in the global batch, index in the data set)`: what the sampler yields."""

_MASK = (1 << 63) - 1


def item_seed(seed: int, step: int, position: int) -> int:
    """The random seed an item is fetched under: distinct for distinct (step, position)."""
    return ((seed * 1_000_003 + step) * 1_000_033 + position) & _MASK


class EpochOrder:
    """Which items each step's global batch holds (see the module docstring)."""

    def __init__(self, num_items: int, global_batch_size: int, seed: int = 0) -> None:
        if global_batch_size <= 0:
            raise ValueError(f"global_batch_size must be positive, got {global_batch_size}")
        if num_items < global_batch_size:
            raise ValueError(
                f"the data set has {num_items} items, fewer than the global batch of "
                f"{global_batch_size} (an epoch holds at least one whole batch)"
            )
        self.num_items, self.global_batch_size, self.seed = num_items, global_batch_size, seed
        self.steps_per_epoch = num_items // global_batch_size
        self._epoch = -1
        self._permutation = torch.empty(0, dtype=torch.long)

    def epoch_of(self, step: int) -> int:
        """The 0-based epoch step `step` (0-based) belongs to."""
        return step // self.steps_per_epoch

    def permutation(self, epoch: int) -> torch.Tensor:
        """Epoch `epoch`'s order of the items `(N,)`; the last one asked is kept."""
        if epoch != self._epoch:
            self._permutation = torch.randperm(
                self.num_items, generator=_generator(self.seed, epoch)
            )
            self._epoch = epoch
        return self._permutation

    def indices(self, step: int) -> torch.Tensor:
        """The global batch's indices `(G,)` at `step`; the same on every rank."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        start = (step % self.steps_per_epoch) * self.global_batch_size
        return self.permutation(self.epoch_of(step))[start : start + self.global_batch_size]

    def keys(self, step: int, rank: int = 0, world_size: int = 1) -> list[ItemKey]:
        """Rank `rank`'s items of `step`: `(step, position, index)` for its rows."""
        b = local_batch_size(self.global_batch_size, rank, world_size)
        mine = self.indices(step)[rank * b : (rank + 1) * b].tolist()
        return [(step, rank * b + row, index) for row, index in enumerate(mine)]


class StepSampler(torch.utils.data.Sampler):
    """A `DataLoader` batch sampler: the item keys of steps `start .. stop - 1` for one rank.

    It runs in the training process (workers only fetch), so the epoch's permutation is
    computed there once per epoch.
    """

    def __init__(self, order: EpochOrder, start: int, stop: int, rank: int, world: int) -> None:
        self.order, self.start, self.stop, self.rank, self.world = order, start, stop, rank, world

    def __iter__(self) -> Iterator[list[ItemKey]]:
        for step in range(self.start, self.stop):
            yield self.order.keys(step, self.rank, self.world)

    def __len__(self) -> int:
        return max(0, self.stop - self.start)


class _RandomState:
    """The CPU random streams an item may draw from (torch, random, numpy), saved to restore."""

    def __init__(self) -> None:
        self.torch = torch.random.default_generator.get_state()
        self.python = random.getstate()
        numpy = sys.modules.get("numpy")  # only if the user's code imported it
        self.numpy = numpy.random.get_state() if numpy is not None else None

    @staticmethod
    def seed(value: int) -> None:
        torch.random.default_generator.manual_seed(value)  # CPU only: CUDA streams untouched
        random.seed(value)
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            numpy.random.seed(value % 2**32)

    def restore(self) -> None:
        torch.random.default_generator.set_state(self.torch)
        random.setstate(self.python)
        numpy = sys.modules.get("numpy")
        if numpy is not None and self.numpy is not None:
            numpy.random.set_state(self.numpy)


class SeededItems(torch.utils.data.Dataset):
    """The user's data set read by `ItemKey`, each item under its own seed (`item_seed`)."""

    def __init__(self, dataset: Any, seed: int) -> None:
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: ItemKey) -> Any:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: list[ItemKey]) -> list[Any]:
        saved = _RandomState()
        try:
            items = []
            for step, position, index in keys:
                _RandomState.seed(item_seed(self.seed, step, position))
                items.append(self.dataset[index])
            return items
        finally:
            saved.restore()
