"""The trainer's data-parallel strategies: `ddp` (every step) and `local-sgd` (every H steps)."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from tessera.data_parallel.ddp import DataParallel
from tessera.data_parallel.naive import average_parameters
from tessera.runtime.context import Context
from tessera.train.strategy import Engine, OptimizerFactory

__all__ = ["DDPEngine", "LocalSGDEngine"]


class DDPEngine(Engine):
    """tessera's `DataParallel`: bulk-synchronous, gradients averaged every step."""

    def __init__(
        self,
        module: nn.Module,
        make_optimizer: OptimizerFactory,
        ctx: Context,
        config: Any = None,
    ) -> None:
        super().__init__(module, make_optimizer, ctx, config)
        self.ddp = DataParallel(
            module,
            bucket_cap_mb=config.bucket_cap_mb if config else 25.0,
            algorithm=config.comm_algorithm if config else "auto",
        )

    def __call__(self, *inputs: Any) -> Any:
        """Forward through `DataParallel`, which prepares this step's gradient reduction."""
        return self.ddp(*inputs)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward; buckets are averaged as they fill, the end waits for the last ones."""
        loss.backward()
        self.comm_seconds = self.ddp.exposed_comm_s


class LocalSGDEngine(Engine):
    """Local SGD: each rank steps on its own gradients; parameters are averaged every H steps.

    Communication drops H-fold; between averages the replicas drift apart, so the result is
    not the single-process one (that is the trade). Optimizer states stay local, as in Lin et
    al. (ICLR 2020). The loss logged is still the mean over ranks.
    """

    def __init__(
        self,
        module: nn.Module,
        make_optimizer: OptimizerFactory,
        ctx: Context,
        config: Any = None,
    ) -> None:
        super().__init__(module, make_optimizer, ctx, config)
        self.period = config.average_every if config else 8
        self.algorithm = config.comm_algorithm if config else "auto"
        self._steps = 0
        average_parameters(module, algorithm=self.algorithm)  # start from one model

    def step(self, lr: float) -> None:
        """Local optimizer step; every `period` steps, average the parameters over ranks."""
        super().step(lr)
        self._steps += 1
        self.comm_seconds = 0.0
        if self._steps % self.period == 0:
            began = time.perf_counter()
            average_parameters(self.module, algorithm=self.algorithm)
            self.comm_seconds = time.perf_counter() - began
