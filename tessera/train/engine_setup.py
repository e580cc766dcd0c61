"""How the trainer builds its engine: its config translated once into `tessera.setup`'s options.

The trainer's flat config (`--bucket-cap-mb`, `--offload`, ...) names each strategy's knobs; the
strategies' policy dataclasses own their meaning and defaults. `policy_options` is the single
place where one becomes the other, so `tessera train` and `tessera.setup` cannot drift apart.
The optimizer and the learning-rate schedule are `tessera.train.optimizers`'; the schedule is a
torch `LambdaLR` over the engine's optimizer, a function of the step only, so a resumed run sets
exactly the rate of the run that never stopped.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from tessera.optim.loss_scale import DynamicLossScaler
from tessera.runtime.context import Context
from tessera.strategies import setup
from tessera.strategies.batch import LossFn
from tessera.strategies.engine import Engine
from tessera.train.config import TrainConfig
from tessera.train.config_strategy import policy_options
from tessera.train.optimizers import lr_at, lr_factor, make_optimizer

__all__ = ["build_engine", "lr_at", "lr_scheduler", "make_optimizer", "policy_options"]


COMPILE_BACKEND_ENV = "TESSERA_COMPILE_BACKEND"
"""`--compile`'s torch.compile backend (default inductor); the suite sets aot_eager, which runs
the same traced graphs without generating kernels (seconds instead of a minute on 2 cores)."""


def build_engine(
    config: TrainConfig,
    model: nn.Module,
    loss_fn: LossFn,
    ctx: Context,
    *,
    init_fn: Callable[[nn.Module], None] | None = None,
) -> Engine:
    """`tessera.setup` of `model` as `config` says (strategy, optimizer, clipping, knobs);
    `init_fn` initialises a meta-device model under zero3 (`tessera.train.build_model`)."""
    extra = {"init_fn": init_fn} if init_fn is not None else {}
    if config.compile:  # in place (Module.compile): state_dict keys and checkpoints unchanged
        model.compile(backend=os.environ.get(COMPILE_BACKEND_ENV) or "inductor")
    return setup(
        model,
        partial(make_optimizer, config),
        strategy=config.strategy,
        loss_fn=loss_fn,
        grad_clip=config.grad_clip,
        grad_accum=config.grad_accum,
        precision=config.mixed_precision or "fp32",
        loss_scaler=_loss_scaler(config),
        ctx=ctx,
        **policy_options(config),
        **extra,
    )


def _loss_scaler(config: TrainConfig) -> DynamicLossScaler | None:
    """fp16's loss scaler as the config sets it; None for any other precision."""
    if config.mixed_precision != "fp16":
        return None
    return DynamicLossScaler(
        config.loss_scale_init, growth_interval=config.loss_scale_growth_interval
    )


def lr_scheduler(engine: Engine, config: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """The config's schedule (`lr_factor`) as a `LambdaLR` over `engine.optimizer`."""
    return torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lr_factor(config))


def restore_lr_scheduler(
    scheduler: torch.optim.lr_scheduler.LambdaLR, saved: dict[str, Any] | None, step: int
) -> None:
    """Put `scheduler` and its optimizer's lr at `step` of the schedule.

    `saved` is the scheduler's `state_dict` from the checkpoint (None for checkpoints written
    before the trainer used one): the schedule is a function of the step, so either way the lr is
    `base_lr * factor(step)`, what the uninterrupted run's `scheduler.step()` set.
    """
    if saved is not None:
        scheduler.load_state_dict(saved)
    scheduler.last_epoch = step
    factors = [fn(step) for fn in scheduler.lr_lambdas]
    lrs = [base * factor for base, factor in zip(scheduler.base_lrs, factors)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs  # what get_last_lr() reports, as after a step
