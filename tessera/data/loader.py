"""The training and evaluation loaders: `torch.utils.data.DataLoader` over the step order.

`step_loader` yields one rank's batch of each step from `start` on, the batches
`DatasetBatches.batch` computes (a pure function of `(seed, step)`), fetched by `num_workers`
worker processes ahead of the step that needs them (`prefetch_factor` batches each), into pinned
memory when the batches go to a CUDA device. The batch sampler (`StepSampler`) starts at the
resumed step, so nothing is skipped or replayed and a resume is exact for any number of workers:
which worker fetches a batch changes nothing, since every item is fetched under its own seed
(`tessera.data.order.SeededItems`). DataLoader returns batches in the sampler's order.

`BatchShape` is the collate step: the user's function (`--collate PKG.MODULE:FN`) or tessera's
`collate`, then, with `--input-keys`/`--target-keys`, a dict batch turned into the pair
`({input key: tensor}, targets)` that calls `model(**inputs)` and `loss(output, targets)`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from tessera.data.batches import collate
from tessera.data.order import EpochOrder, SeededItems, StepSampler

__all__ = ["BatchShape", "default_workers", "select_keys", "split_keys", "step_loader"]


def split_keys(spec: str | None) -> tuple[str, ...]:
    """`"a,b"` -> `("a", "b")`; None or "" -> `()`."""
    return tuple(k.strip() for k in (spec or "").split(",") if k.strip())


class BatchShape:
    """Items -> the batch the engine takes (see the module docstring); picklable, so it runs
    in the loader's worker processes."""

    def __init__(
        self,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        input_keys: Sequence[str] = (),
        target_keys: Sequence[str] = (),
    ) -> None:
        self.collate_fn = collate_fn if collate_fn is not None else collate
        self.input_keys, self.target_keys = tuple(input_keys), tuple(target_keys)

    def __call__(self, items: list[Any]) -> Any:
        """The batch of `items`."""
        batch = self.collate_fn(items)
        if not (self.input_keys or self.target_keys):
            return batch
        return select_keys(batch, self.input_keys, self.target_keys)


def select_keys(batch: Any, input_keys: Sequence[str], target_keys: Sequence[str]) -> Any:
    """A dict batch as `({k: batch[k] for k in input_keys}, targets)`: the targets are the one
    target key's tensor, or a dict of several; ValueError naming a missing key."""
    if not isinstance(batch, Mapping):
        raise ValueError(
            f"--input-keys/--target-keys select fields of dict batches, got a "
            f"{type(batch).__name__}"
        )
    missing = [k for k in (*input_keys, *target_keys) if k not in batch]
    if missing:
        raise ValueError(f"the batch has no key {missing[0]!r}; its keys: {sorted(batch)}")
    if not input_keys or not target_keys:
        raise ValueError("--input-keys and --target-keys go together (both name dict keys)")
    inputs = {k: batch[k] for k in input_keys}
    if len(target_keys) == 1:
        return inputs, batch[target_keys[0]]
    return inputs, {k: batch[k] for k in target_keys}


def default_workers(ranks_on_machine: int) -> int:
    """Loader workers per rank when --num-workers is not given: the cores left per rank after
    the rank's own (at most 4), 0 when no core is left (workers would only compete with the
    ranks: on 2 cores and 2 ranks, fetching in the rank is faster)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(0, min(4, (cores or 1) // max(1, ranks_on_machine) - 1))


def step_loader(
    dataset: Any,
    order: EpochOrder,
    shape: Callable[[list[Any]], Any],
    *,
    start: int,
    stop: int,
    rank: int,
    world_size: int,
    num_workers: int,
    pin_memory: bool,
) -> Iterable[Any]:
    """Rank `rank`'s batches of steps `start .. stop - 1`, in step order (module docstring).

    Why so many parameters: the data, its order and shape, the steps, the rank, and how to
    fetch them are independent; bundling them would only rename them.
    """
    return torch.utils.data.DataLoader(
        SeededItems(dataset, order.seed),
        batch_sampler=StepSampler(order, start, stop, rank, world_size),
        collate_fn=shape,
        num_workers=num_workers,
        pin_memory=pin_memory,
        # DataLoader draws its workers' base seed from this generator, not from the training
        # process's global stream (which would shift dropout by one draw at every resume)
        generator=torch.Generator().manual_seed(order.seed),
    )
