"""`strategy="torch-ddp"`: PyTorch's own DistributedDataParallel, the anchor of tessera's DDP.

DDP broadcasts rank 0's weights at construction and all-reduces gradient buckets during
backward. The exposed communication time is measured from outside DDP: a post-accumulate hook
on every parameter records when the last gradient was produced; what remains of backward after
that is DDP waiting for its last buckets, i.e. communication that compute did not hide.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
from torch import nn

from tessera.runtime.context import Context
from tessera.strategies.batch import LossFn
from tessera.strategies.engine import Engine, NoOptions, OptimizerFactory

__all__ = ["NoOptions", "TorchDDPEngine", "build"]


class TorchDDPEngine(Engine):
    """`torch.nn.parallel.DistributedDataParallel` around the user's model."""

    def __init__(
        self,
        module: nn.Module,
        optimizer_factory: OptimizerFactory,
        ctx: Context,
        *,
        loss_fn: LossFn | None = None,
        grad_clip: float = 0.0,
        policy: Any = None,
    ) -> None:
        super().__init__(
            module, optimizer_factory, ctx, loss_fn=loss_fn, grad_clip=grad_clip, policy=policy
        )
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        self.ddp = nn.parallel.DistributedDataParallel(module, device_ids=device_ids)
        self._last_gradient_at = 0.0
        for parameter in module.parameters():
            if parameter.requires_grad:
                parameter.register_post_accumulate_grad_hook(self._mark_gradient)

    def _mark_gradient(self, _parameter: torch.Tensor) -> None:
        self._last_gradient_at = time.perf_counter()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Forward through DDP, which prepares the gradient reduction of this step."""
        return self.ddp(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward; DDP's hooks all-reduce (average) gradients as buckets fill."""
        self._last_gradient_at = time.perf_counter()
        loss.backward()
        self.comm_seconds = max(0.0, time.perf_counter() - self._last_gradient_at)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """`DistributedDataParallel.no_sync`: gradients accumulate locally until the next
        synced backward, which all-reduces their sum once."""
        return self.ddp.no_sync()


def build(
    model: nn.Module,
    optimizer_factory: OptimizerFactory,
    ctx: Context,
    *,
    loss_fn: LossFn | None = None,
    grad_clip: float = 0.0,
    policy: Any = None,
) -> Engine:
    """PyTorch DDP over the default group."""
    return TorchDDPEngine(
        model, optimizer_factory, ctx, loss_fn=loss_fn, grad_clip=grad_clip, policy=policy
    )
