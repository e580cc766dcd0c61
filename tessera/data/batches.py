"""Batches of a map-style data set: the global batch of a step as a pure function of (seed, step).

The trainer draws from a user's `torch.utils.data.Dataset` without a DataLoader or sampler state:
the global batch of `step` is `global_batch_size` distinct indices drawn by a generator seeded
from `(seed, step)`, collated, and rank r keeps rows `[r*b, (r+1)*b)` (`b = G // world`) exactly
as `tessera.data.sharding` cuts the demo corpus. So a resumed run draws the batches an
uninterrupted one would, and the ranks' batches together are the one-process batch row for row.

Items are `(inputs, targets)` pairs or dicts of tensors (numbers count as 0-d tensors); a batch
stacks them: a pair of stacked tensors, or a dict of stacked tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tessera.data.sharding import _generator, local_batch_size

__all__ = ["Batch", "DatasetBatches", "collate", "item_kind"]

Batch = tuple[torch.Tensor, torch.Tensor] | dict[str, torch.Tensor]
"""A collated batch: (inputs, targets), or a dict of tensors with the batch on dim 0."""

_LEAF = (torch.Tensor, int, float, bool)


def item_kind(item: Any) -> str:
    """ "pair" or "dict" for a valid item; ValueError saying what the item is otherwise."""
    if isinstance(item, Mapping):
        if not item:
            raise ValueError("an item is an empty dict")
        for key, value in item.items():
            if not isinstance(key, str) or not isinstance(value, _LEAF):
                raise ValueError(
                    f"a dict item maps strings to tensors; key {key!r} holds a "
                    f"{type(value).__name__}"
                )
        return "dict"
    if isinstance(item, (tuple, list)) and len(item) == 2:
        for name, value in zip(("inputs", "targets"), item):
            if not isinstance(value, _LEAF):
                raise ValueError(
                    f"an (inputs, targets) item holds tensors; its {name} is a "
                    f"{type(value).__name__}"
                )
        return "pair"
    shape = f"a {len(item)}-tuple" if isinstance(item, (tuple, list)) else type(item).__name__
    raise ValueError(f"items must be (inputs, targets) pairs or dicts of tensors, got {shape}")


def _stack(values: Sequence[Any], what: str) -> torch.Tensor:
    tensors = [v if isinstance(v, torch.Tensor) else torch.as_tensor(v) for v in values]
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) > 1:
        raise ValueError(f"{what} has items of different shapes {sorted(shapes)}: pad them")
    return torch.stack(tensors)


def collate(items: Sequence[Any]) -> Batch:
    """Stack items of one kind into a batch: pairs -> (inputs, targets), dicts -> dict."""
    kinds = {item_kind(item) for item in items}
    if len(kinds) != 1:
        raise ValueError(f"a batch mixes item kinds {sorted(kinds)}")
    if kinds == {"pair"}:
        return _stack([i[0] for i in items], "inputs"), _stack([i[1] for i in items], "targets")
    keys = list(items[0])
    for item in items:
        if list(item) != keys:
            raise ValueError(f"dict items have different keys: {keys} and {list(item)}")
    return {key: _stack([item[key] for item in items], f"field {key!r}") for key in keys}


class DatasetBatches:
    """Per-rank batches of a map-style data set (`__len__`, `__getitem__`), sharded by rank.

    The global batch of `step` holds `global_batch_size` distinct indices (sampled without
    replacement within the batch by a generator seeded from `(seed, step)`); batches of different
    steps are drawn independently.
    """

    def __init__(self, dataset: Any, *, global_batch_size: int, seed: int = 0) -> None:
        if global_batch_size <= 0:
            raise ValueError(f"global_batch_size must be positive, got {global_batch_size}")
        size = len(dataset)
        if size < global_batch_size:
            raise ValueError(
                f"the data set has {size} items, fewer than the global batch of "
                f"{global_batch_size} (items are drawn without replacement within a batch)"
            )
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.seed = seed

    def indices(self, step: int) -> torch.Tensor:
        """The global batch's indices `(G,)` at `step`; the same on every rank."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        order = torch.randperm(len(self.dataset), generator=_generator(self.seed, step))
        return order[: self.global_batch_size]

    def batch(self, step: int, rank: int = 0, world_size: int = 1) -> Batch:
        """Rank `rank`'s rows `[rank*b, (rank+1)*b)` of the global batch of `step`, collated."""
        b = local_batch_size(self.global_batch_size, rank, world_size)
        mine = self.indices(step)[rank * b : (rank + 1) * b]
        return collate([self.dataset[int(i)] for i in mine])
