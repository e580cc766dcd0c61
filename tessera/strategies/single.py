"""`strategy="single"`: one process, plain PyTorch (the `Engine` base itself).

Under several ranks every rank trains its own copy without communicating (the trainer refuses
that; from Python it is the per-rank reference the other strategies are compared with).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from tessera.runtime.context import Context
from tessera.strategies.batch import LossFn
from tessera.strategies.engine import Engine, NoOptions, OptimizerFactory

__all__ = ["NoOptions", "build"]


def build(
    model: nn.Module,
    optimizer_factory: OptimizerFactory,
    ctx: Context,
    *,
    loss_fn: LossFn | None = None,
    grad_clip: float = 0.0,
    policy: Any = None,
) -> Engine:
    """An `Engine` over the whole model: the reference every other strategy must equal."""
    return Engine(
        model, optimizer_factory, ctx, loss_fn=loss_fn, grad_clip=grad_clip, policy=policy
    )
