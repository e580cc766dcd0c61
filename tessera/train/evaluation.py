"""The trainer's evaluation: every `--eval-every` steps and at the end, the mean loss over the
same `--eval-batches` held-out batches (the corpus's held-out end, or `--eval-data`).

The batches are a pure function of the seed (`Workload.eval_batches`), drawn once and kept, so
every evaluation compares the model on the same data. `engine.eval_step` leaves training as it
was (no gradient, no optimizer or RNG state touched), so a run that evaluates takes exactly the
steps of one that does not. The value is the mean over the batches of each rank's loss, averaged
over the ranks (equal shards: the global batches' mean loss).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tessera.runtime.context import Context
from tessera.strategies import Engine
from tessera.train.config import TrainConfig
from tessera.train.workload import Workload

__all__ = ["Evaluator"]


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

    def due(self, done: int) -> bool:
        """Whether to evaluate after `done` steps: every `eval_every`, and at the last step."""
        return self.every > 0 and (done % self.every == 0 or done == self.last)

    def run(self, engine: Engine) -> float:
        """The held-out loss, the same on every rank (collective)."""
        if self._batches is None:
            make = self.workload.eval_batches
            assert make is not None  # built whenever eval_every > 0
            ctx = self.ctx
            self._batches = [
                self.to_device(make(i, ctx.rank, ctx.world_size), ctx.device)
                for i in range(self.count)
            ]
        losses = [engine.eval_step(batch) for batch in self._batches]
        total = torch.tensor([sum(losses)], dtype=torch.float64)
        if self.ctx.world_size > 1:
            total = total.to(self.ctx.device)
            dist.all_reduce(total)
        return float(total) / (self.count * self.ctx.world_size)
