"""Batches of an iterable (streaming) data set: `torch.utils.data.IterableDataset`, a Hugging Face
streaming dataset, a reader of shards larger than memory.

The stream is the data set's epochs one after another (`set_epoch(e)` is called before epoch `e`
where the data set has it, as Hugging Face's and PyTorch's samplers expect, so it may reshuffle),
and the global batch of step `s` is its items `[s*G, (s+1)*G)`: a batch may cross an epoch's end,
and every item is taken once per epoch, none dropped or padded. Rank r keeps rows
`[r*b, (r+1)*b)` of each global batch, so the ranks' batches together are the one-process batch.

Every rank and every loader worker reads the stream from the start (or the resumed position)
and keeps only its own items: worker `w` of `W` builds the batches of steps `start + w`,
`start + w + W`, ..., which DataLoader hands out round-robin, i.e. in step order. Nothing
needs to know the data set's length. Reading costs every worker the whole stream: items whose
production is expensive belong in a map-style data set (or in the collate function, which runs
only on a worker's own items).

The stream's random draws (a shuffle buffer, augmentation in `__iter__`) come from its own
generator, seeded from `(seed, epoch)` and swapped in around each item, so every reader sees
the same stream and training's own random streams are untouched.

Resume: each batch carries the stream's position after it, `(epoch, items read in it)`;
`StreamLoader.state_dict` is that of the last batch handed out, and the checkpoint keeps it. A
resumed loader starts at that epoch and skips that many items.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from tessera.data.order import _RandomState, item_seed
from tessera.data.sharding import local_batch_size

__all__ = ["StreamLoader", "is_stream", "stream_items"]


def is_stream(dataset: Any) -> bool:
    """Whether `dataset` is read by iterating (no `__getitem__` by index, or an IterableDataset)."""
    return isinstance(dataset, torch.utils.data.IterableDataset) or (
        hasattr(dataset, "__iter__") and not hasattr(dataset, "__getitem__")
    )


def stream_items(dataset: Any, seed: int, epoch: int = 0, skip: int = 0) -> Iterator[Any]:
    """Epoch `epoch`'s items from item `skip` on, each drawn under the stream's own generator."""
    if hasattr(dataset, "set_epoch"):
        dataset.set_epoch(epoch)
    saved = _RandomState()
    _RandomState.seed(item_seed(seed, epoch, 1 << 40))  # the stream's own, per epoch
    try:
        items = iter(dataset)
        for _ in range(skip):
            next(items)
    except StopIteration:
        return
    finally:
        own = _RandomState()  # the stream's generator as it now is
        saved.restore()  # training's, as it was
    while True:
        saved = _RandomState()
        own.restore()
        try:
            item = next(items)
        except StopIteration:
            return
        finally:
            own = _RandomState()
            saved.restore()
        yield item


class _StreamBatches(torch.utils.data.IterableDataset):
    """What one loader worker yields: `{"batch", "state"}` for its steps (module docstring)."""

    def __init__(
        self,
        dataset: Any,
        shape: Callable[[list[Any]], Any],
        global_batch_size: int,
        steps: tuple[int, int],
        rank_world: tuple[int, int],
        seed: int,
        state: tuple[int, int],
    ) -> None:
        self.dataset, self.shape, self.seed = dataset, shape, seed
        self.global_batch_size, self.steps, self.rank_world = global_batch_size, steps, rank_world
        self.state = state

    def _positions(self) -> Iterator[tuple[Any, int, int]]:
        """`(item, epoch, items read in that epoch after it)` of the endless stream."""
        epoch, skip = self.state
        while True:
            read = skip
            for item in stream_items(self.dataset, self.seed, epoch, skip):
                read += 1
                yield item, epoch, read
            if read == skip:
                raise ValueError(f"the streaming data set yielded no items in epoch {epoch}")
            epoch, skip = epoch + 1, 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        rank, world = self.rank_world
        b = local_batch_size(self.global_batch_size, rank, world)
        start, stop = self.steps
        if start >= stop:
            return
        mine: list[Any] = []
        for position, (item, epoch, read) in enumerate(self._positions()):
            step, row = divmod(position, self.global_batch_size)
            step += start
            if step >= stop:
                return
            if (step - start) % workers == worker and rank * b <= row < (rank + 1) * b:
                mine.append(item)
            if row == self.global_batch_size - 1 and (step - start) % workers == worker:
                yield {"batch": self.shape(mine), "state": (epoch, read)}
                mine = []


def _unchanged(batch: Any) -> Any:
    return batch


class StreamLoader:
    """One rank's batches of steps `start .. stop - 1` of a stream, and the position reached."""

    def __init__(
        self,
        dataset: Any,
        shape: Callable[[list[Any]], Any],
        *,
        global_batch_size: int,
        steps: tuple[int, int],
        rank_world: tuple[int, int],
        seed: int,
        num_workers: int,
        pin_memory: bool,
        state: dict[str, int] | None = None,
    ) -> None:
        """Why so many parameters: as `tessera.data.loader.step_loader`, plus the position a
        resumed run starts at (`state`, from `state_dict`)."""
        self.position = (state["epoch"], state["read"]) if state else (0, 0)
        batches = _StreamBatches(
            dataset, shape, global_batch_size, steps, rank_world, seed, self.position
        )
        self.loader = torch.utils.data.DataLoader(
            batches,
            batch_size=None,
            collate_fn=_unchanged,
            num_workers=num_workers,
            pin_memory=pin_memory,
            generator=torch.Generator().manual_seed(seed),
        )

    def __iter__(self) -> Iterator[Any]:
        for out in self.loader:
            self.position = tuple(int(v) for v in out["state"])
            yield out["batch"]

    def state_dict(self) -> dict[str, int]:
        """The stream's position after the last batch handed out (what a resume starts at)."""
        return {"epoch": self.position[0], "read": self.position[1]}
