"""`strategy="ddp"` (tessera's `DataParallel`, gradients averaged every step) and
`strategy="local-sgd"` (parameters averaged every H steps)."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tessera.data_parallel.ddp import DataParallel
from tessera.data_parallel.naive import average_parameters
from tessera.data_parallel.policy import DDPPolicy, LocalSGDPolicy
from tessera.errors import CheckpointError
from tessera.runtime.context import Context
from tessera.strategies.capabilities import Capabilities
from tessera.strategies.engine import Engine, OptimizerFactory
from tessera.strategies.registry import declare_strategy

__all__ = [
    "DDPEngine",
    "DDPPolicy",
    "LocalSGDEngine",
    "LocalSGDPolicy",
    "build_ddp",
    "build_local_sgd",
]


class DDPEngine(Engine):
    """tessera's `DataParallel`: bulk-synchronous, gradients averaged every step."""

    items_over_ranks = True  # gradients averaged over ranks: Engine._items_scale

    def __init__(
        self,
        module: nn.Module,
        optimizer_factory: OptimizerFactory,
        ctx: Context,
        *,
        policy: DDPPolicy | None = None,
        **steps: Any,
    ) -> None:
        """`steps`: `Engine`'s cross-cutting keywords (loss_fn, grad_clip, precision, ...)."""
        policy = policy if policy is not None else DDPPolicy()
        self.ddp = DataParallel(
            module,
            bucket_cap_mb=policy.bucket_cap_mb,
            algorithm=policy.algorithm,
            find_unused_parameters=policy.find_unused_parameters,
            timeout_s=ctx.timeout_s,
        )
        super().__init__(module, optimizer_factory, ctx, policy=policy, **steps)

    def reduce_gradients_in(self, dtype: torch.dtype) -> None:
        """Average each bucket in `dtype` (cast for the all-reduce, written back into the fp32
        gradients)."""
        self.ddp.reduce_in(dtype)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Forward through `DataParallel`, which prepares this step's gradient reduction."""
        return self.ddp(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward (of the fp16-scaled loss); buckets are averaged as they fill, the end waits
        for the last ones."""
        self.scaled(loss).backward()
        self.comm_seconds = self.ddp.exposed_comm_s

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Accumulate gradients locally; the next synced backward reduces their sum once."""
        return self.ddp.no_sync()


class LocalSGDEngine(Engine):
    """Local SGD: each rank steps on its own gradients; parameters are averaged every H steps.

    Communication drops H-fold; between averages the replicas drift apart, so the result is
    not the single-process one (that is the trade; with H = 1 and SGD without momentum it is).
    Optimizer states stay local, as in Lin et al. (ICLR 2020).

    A checkpoint therefore holds every rank's replica and optimizer state and the number of
    steps since the last average: resuming mid-period continues each replica where it was, so
    the run is the one that never stopped, bit for bit.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer_factory: OptimizerFactory,
        ctx: Context,
        *,
        policy: LocalSGDPolicy | None = None,
        **steps: Any,
    ) -> None:
        """`steps`: `Engine`'s cross-cutting keywords (loss_fn, grad_clip, precision, ...)."""
        policy = policy if policy is not None else LocalSGDPolicy()
        super().__init__(module, optimizer_factory, ctx, policy=policy, **steps)
        self.period = policy.average_every
        self.algorithm = policy.algorithm
        self._steps = 0
        average_parameters(module, algorithm=self.algorithm)  # start from one model

    def optimizer_step(self) -> None:
        """Local optimizer step; every `period` steps, average the parameters over ranks."""
        super().optimizer_step()
        self._steps += 1
        self.comm_seconds = 0.0
        if self._steps % self.period == 0:
            began = time.perf_counter()
            average_parameters(self.module, algorithm=self.algorithm)
            self.comm_seconds = time.perf_counter() - began

    def state_dict(self) -> dict[str, Any]:
        """Every rank's replica and optimizer state (collective), complete on rank 0.

        `model` / `optimizer` are rank 0's (what a reader of one model wants); `replicas` holds
        every rank's, in rank order; `steps_since_average` the position in the period.
        """
        mine = {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}
        replicas: list[Any] = [mine]
        if self.ctx.world_size > 1:
            replicas = [None] * self.ctx.world_size if self.ctx.rank == 0 else []
            dist.gather_object(mine, replicas if self.ctx.rank == 0 else None, dst=0)
        if self.ctx.rank != 0:
            return {}
        return self.precision_state(
            {
                **replicas[0],
                "replicas": replicas,
                "steps_since_average": self._steps % self.period,
            }
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore this rank's own replica and optimizer state, and the averaging counter."""
        replicas = state.get("replicas")
        if replicas is None:
            raise CheckpointError(
                "this local-sgd checkpoint holds rank 0's replica only (saved by an older "
                "tessera): it cannot resume every rank exactly"
            )
        if len(replicas) != self.ctx.world_size:
            raise CheckpointError(
                f"local-sgd checkpoint holds {len(replicas)} replicas, this run has "
                f"{self.ctx.world_size} ranks: local SGD resumes on the same number of ranks"
            )
        since_average = state["steps_since_average"]
        if since_average >= self.period:
            raise CheckpointError(
                f"the checkpoint is {since_average} steps past an average, more than this run's "
                f"average_every {self.period}"
            )
        self.module.load_state_dict(replicas[self.ctx.rank]["model"])
        self.optimizer.load_state_dict(replicas[self.ctx.rank]["optimizer"])
        self._steps = since_average
        self.load_precision_state(state)


build_ddp = DDPEngine
"""The `ddp` strategy's builder (the registry's name for the engine class)."""
build_local_sgd = LocalSGDEngine
"""The `local-sgd` strategy's builder."""

declare_strategy(
    "ddp",
    DDPEngine,
    policy=DDPPolicy,
    capabilities=Capabilities(elastic=True, resume_any_world=True),
)
declare_strategy(
    "local-sgd",
    LocalSGDEngine,
    policy=LocalSGDPolicy,
    capabilities=Capabilities(world_bound="it keeps one model replica per rank between averages"),
)
