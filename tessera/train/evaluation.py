"""The trainer's evaluation: every `--eval-every` steps and at the end, the held-out loss.

By default (`--eval-batches 0`) one pass over all of `--eval-data`, split over the ranks with
every item once (`tessera.data.passes`, fetched by the loader's workers): `val_loss` is the mean
over the items of the per-batch mean loss, each batch weighted by its items, which is what a
plain loop over the set computes for a loss averaged over a batch's rows. A loss averaged over
tokens (labels -100, `ignore_index`, a loss's `count_items`: `tessera.strategies.batch.
item_counter`, the rule accumulation weighs by) weighs each batch by its tokens instead, so
`val_loss` is the mean over every token of the set, not a mean of batch means. With
`--eval-batches K` (and for the demo's held-out text) the same K batches, a pure function of
the seed (`Workload.eval_batches`), drawn once and kept.

`engine.eval_step` leaves training as it was (no gradient, no optimizer or RNG state touched), so
a run that evaluates takes exactly the steps of one that does not.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tessera.runtime.context import Context
from tessera.strategies import Engine
from tessera.strategies.batch import item_counter, loss_targets
from tessera.train.config import TrainConfig
from tessera.train.workload import Workload

__all__ = ["DEMO_EVAL_BATCHES", "Evaluator"]

DEMO_EVAL_BATCHES = 4
"""The demo's evaluation batches when `--eval-batches` is 0: its held-out text has no items to
pass over, only windows drawn at random."""


class Evaluator:
    """When to evaluate, and the held-out loss of the engine's current model."""

    def __init__(
        self,
        config: TrainConfig,
        workload: Workload,
        ctx: Context,
        to_device: Callable[[Any, torch.device], Any],
    ) -> None:
        self.every, self.count, self.last = config.eval_every, config.eval_batches, config.steps
        self.workload, self.ctx, self.to_device = workload, ctx, to_device
        self._batches: list[Any] | None = None
        self.spent_s = 0.0
        """Seconds spent evaluating so far (the loop leaves them out of the steps' time)."""

    def due(self, done: int) -> bool:
        """Whether to evaluate after `done` steps: every `eval_every`, and at the last step."""
        return self.every > 0 and (done % self.every == 0 or done == self.last)

    def run(self, engine: Engine) -> float:
        """The held-out loss, the same on every rank (collective)."""
        began = time.perf_counter()
        try:
            return self._run(engine)
        finally:
            self.spent_s += time.perf_counter() - began

    def _run(self, engine: Engine) -> float:
        ctx = self.ctx
        if self.workload.eval_pass is not None:
            weighted = self.workload.eval_pass(
                rank=ctx.rank, world_size=ctx.world_size, pin_memory=ctx.device.type == "cuda"
            )
        else:
            weighted = [(batch, 1) for batch in self._kept_batches()]
        count = item_counter(engine.loss_fn, engine.module)  # None: a batch's rows are its items
        total = torch.zeros(2, dtype=torch.float64)  # (sum of weight * loss, sum of weights)
        for batch, weight in weighted:
            # a data-parallel rank's loss is its share's; an engine that gathers the batch
            # returns the whole batch's on every rank: weighted by this rank's share, it counts
            # once with the whole batch's items (tessera.data.passes); a token-averaged loss
            # counts this rank's tokens in the same way
            tokens = count(loss_targets(batch)) if count is not None and weight else None
            weight = weight if tokens is None else tokens
            total[0] += float(engine.eval_step(self.to_device(batch, ctx.device))) * weight
            total[1] += weight
        if ctx.world_size > 1:
            total = total.to(ctx.device)
            dist.all_reduce(total)
        return float(total[0] / total[1])

    def _kept_batches(self) -> list[Any]:
        """The `--eval-batches` batches (the same at every evaluation), drawn once."""
        if self._batches is None:
            make = self.workload.eval_batches
            assert make is not None  # built whenever eval_every > 0 without eval_pass
            ctx = self.ctx
            count = self.count or DEMO_EVAL_BATCHES
            self._batches = [make(i, ctx.rank, ctx.world_size) for i in range(count)]
        return self._batches
