"""Batches of a map-style data set: the global batch of a step as a pure function of (seed, step).

The global batch of `step` is the items `tessera.data.order.EpochOrder` gives it (epochs of a
seeded permutation), each fetched under its own seed, collated; rank r keeps rows
`[r*b, (r+1)*b)` (`b = G // world`) exactly as `tessera.data.sharding` cuts the demo corpus. So a
resumed run draws the batches an uninterrupted one would, and the ranks' batches together are the
one-process batch row for row. `DatasetBatches.batch` computes one step's batch in this process;
`tessera.data.loader` fetches the same batches in worker processes.

Items are `(inputs, targets)` pairs or dicts of tensors (numbers count as 0-d tensors); the inputs
of a pair may be a tuple of tensors (`((a, b), y)`: the model is called `model(a, b)`). `collate`
stacks them: a pair of stacked tensors (or of a tuple of them), or a dict of stacked tensors. A
user's collate function (`--collate`) takes any items instead (padding variable-length ones).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from tessera.data.order import EpochOrder, SeededItems

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
            tupled = name == "inputs" and isinstance(value, (tuple, list)) and len(value) > 0
            for leaf in value if tupled else [value]:  # ((a, b), y): inputs a tuple
                if not isinstance(leaf, _LEAF):
                    raise ValueError(
                        f"an (inputs, targets) item holds tensors; its {name} is a "
                        f"{type(leaf).__name__}"
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
        targets = _stack([i[1] for i in items], "targets")
        if isinstance(items[0][0], (tuple, list)):  # ((a, b), y): model(a, b)
            width = {len(i[0]) for i in items}
            if len(width) != 1:
                raise ValueError(f"items' input tuples have different lengths {sorted(width)}")
            columns = zip(*(i[0] for i in items))
            inputs = tuple(_stack(list(c), f"input {n}") for n, c in enumerate(columns))
            return inputs, targets
        return _stack([i[0] for i in items], "inputs"), targets
    keys = list(items[0])
    for item in items:
        if list(item) != keys:
            raise ValueError(f"dict items have different keys: {keys} and {list(item)}")
    return {key: _stack([item[key] for item in items], f"field {key!r}") for key in keys}


class DatasetBatches:
    """Per-rank batches of a map-style data set (`__len__`, `__getitem__`), sharded by rank.

    The global batch of `step` holds the `global_batch_size` items `EpochOrder` gives it;
    `collate_fn` (default `collate`) makes them a batch.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        global_batch_size: int,
        seed: int = 0,
        collate_fn: Callable[[list[Any]], Any] = collate,
    ) -> None:
        self.order = EpochOrder(len(dataset), global_batch_size, seed)
        self.dataset, self.items = dataset, SeededItems(dataset, seed)
        self.global_batch_size, self.seed, self.collate_fn = global_batch_size, seed, collate_fn

    def indices(self, step: int) -> torch.Tensor:
        """The global batch's indices `(G,)` at `step`; the same on every rank."""
        return self.order.indices(step)

    def batch(self, step: int, rank: int = 0, world_size: int = 1) -> Batch:
        """Rank `rank`'s rows `[rank*b, (rank+1)*b)` of the global batch of `step`, collated."""
        return self.collate_fn(self.items.__getitems__(self.order.keys(step, rank, world_size)))
