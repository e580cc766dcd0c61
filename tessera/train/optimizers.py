"""The trainer's optimizer and learning-rate schedule: `--optimizer`, `--optimizer-args`,
`--lr-schedule`, and the checks of `--grad-accum` that go with them.

`--optimizer` is `adamw`, `sgd` or a user's `PKG.MODULE:CLASS` (any `torch.optim.Optimizer`
subclass, imported like `--model`'s factory: `tessera.data.imports`); it is built with `lr` and,
where its signature takes it, `weight_decay`, then `--optimizer-args` (a JSON object) on top.
The weight decay applies to parameters of 2+ dims only (two parameter groups, built the torch
way: `decay_groups`); biases and norm weights are not decayed, as in Hugging Face's Trainer.
The decay of a `--model`'s schedule spans its run: `--decay-steps` unset is `--steps` minus the
warmup (`decay_steps`); the demo GPT keeps its tuned 450.
`--lr-schedule` is `cosine`, `linear` or `constant` after a linear warmup, or a user's
`PKG.MODULE:FN` whose `FN(step)` is the multiplier of `--lr` at the 0-based step. Every schedule
is a function of the step only: a resumed run sets exactly the rate of the run that never
stopped. Under ZeRO (`offload` turns AdamW/Adam into `CPUAdam`) any element-wise `torch.optim`
class trains.

Everything here that can be refused is refused before a rank starts: the spelling in the config
(`check_optimizer_options`, in `tessera.train.config_optimizer` so that the config can run it
without importing this module, which reads a `TrainConfig`), the import and one construction on
a dummy parameter and one call of the schedule in preflight (`check_optimizer_and_schedule`).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from functools import partial
from numbers import Real
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tessera.data.imports import load_reference
from tessera.errors import ConfigError
from tessera.train.config_optimizer import (
    LR_SCHEDULES,
    OPTIMIZERS,
    check_optimizer_options,
    parse_optimizer_args,
)

if TYPE_CHECKING:
    from tessera.train.config import TrainConfig

__all__ = [
    "LR_SCHEDULES",
    "OPTIMIZERS",
    "check_optimizer_and_schedule",
    "check_optimizer_options",
    "decay_groups",
    "decay_steps",
    "lr_at",
    "lr_factor",
    "make_optimizer",
    "optimizer_spec",
    "parse_optimizer_args",
]

def _takes(cls: type, name: str) -> bool:
    parameters = inspect.signature(cls.__init__).parameters
    return name in parameters or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()
    )


def optimizer_spec(config: TrainConfig) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The optimizer class the config names and its keyword arguments (without params)."""
    if config.optimizer == "adamw":
        cls: Any = torch.optim.AdamW
        kwargs: dict[str, Any] = {"betas": (0.9, 0.95), "weight_decay": config.weight_decay}
    elif config.optimizer == "sgd":
        cls, kwargs = torch.optim.SGD, {"momentum": 0.9}  # no weight decay: as before
    else:
        cls = load_reference(config.optimizer, what="--optimizer")
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise ConfigError(
                f"--optimizer {config.optimizer!r} is not a torch.optim.Optimizer subclass"
            )
        kwargs = {"weight_decay": config.weight_decay} if _takes(cls, "weight_decay") else {}
    return cls, {"lr": config.lr, **kwargs, **parse_optimizer_args(config.optimizer_args)}


def decay_groups(params: Any, weight_decay: float) -> list[dict[str, Any]]:
    """`params` as two torch parameter groups: tensors of 2+ dims (weight matrices, embeddings,
    convolution kernels) decay by `weight_decay`, 1-D and 0-D ones (biases, norm gains, scales)
    by 0, the default of Hugging Face's Trainer and nanoGPT: decaying a norm's gain towards 0
    or a bias shrinks what no regularisation asked for. An empty group is left out."""
    params = list(params)
    if params and isinstance(params[0], dict):
        return params  # the caller's own groups: kept as they are
    # a parameter server's piece of a flattened parameter keeps the parameter's dims
    matrices = [p for p in params if getattr(p, "source_ndim", p.dim()) >= 2]
    vectors = [p for p in params if getattr(p, "source_ndim", p.dim()) < 2]
    groups = [{"params": matrices, "weight_decay": weight_decay}] if matrices else []
    return groups + ([{"params": vectors, "weight_decay": 0.0}] if vectors else [])


def make_optimizer(config: TrainConfig, params: Any) -> torch.optim.Optimizer:
    """The optimizer the config names, over `params` (at the peak lr: the schedule scales it);
    where it takes a weight decay, only parameters of 2+ dims get it (`decay_groups`)."""
    cls, kwargs = optimizer_spec(config)
    params = list(params)
    if config.optimizer == "adamw" and "fused" not in kwargs and "foreach" not in kwargs:
        kwargs = {**kwargs, "fused": True} if _all_on_cuda(params) else kwargs
    if "weight_decay" in kwargs:
        return cls(decay_groups(params, kwargs["weight_decay"]), **kwargs)
    return cls(params, **kwargs)


DEMO_DECAY_STEPS = 450
"""The demo GPT's decay when `--decay-steps` is unset: tuned with its 450 default steps, and
fixed, so that a demo run extended by `--resume` equals one run straight to the same step."""


def decay_steps(config: TrainConfig) -> int:
    """`--decay-steps`, or unset: the run's `--steps` minus the warmup for a `--model` (the
    decay spans the run), `DEMO_DECAY_STEPS` for the demo GPT."""
    if config.decay_steps is not None:
        return config.decay_steps
    if config.model_factory is None:
        return DEMO_DECAY_STEPS
    return max(0, config.steps - config.warmup_steps)


def _all_on_cuda(params: list[Any]) -> bool:
    """Are all `params` (tensors or param-group dicts) CUDA floating-point tensors? Then the
    built-in AdamW runs fused: one kernel for every parameter's update instead of a chain of
    foreach kernels (PyTorch's own advice for CUDA; on the CPU the default path is kept, the one
    the suite's plain loops use)."""
    tensors: list[Any] = []
    for item in params:
        tensors += list(item["params"]) if isinstance(item, dict) else [item]
    return bool(tensors) and all(
        isinstance(t, torch.Tensor) and t.is_cuda and t.is_floating_point() for t in tensors
    )


def _builtin_factor(config: TrainConfig, step: int) -> float:
    """Linear warmup to 1, then cosine or linear to 1/10 over `decay_steps` (0: constant)."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    decay = decay_steps(config)
    if config.lr_schedule == "constant" or decay == 0:
        return 1.0
    progress = min(1.0, (step - config.warmup_steps) / decay)
    if config.lr_schedule == "linear":
        return 1.0 - 0.9 * progress
    return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))


def lr_factor(config: TrainConfig) -> Callable[[int], float]:
    """`step -> multiplier of config.lr`: the built-in schedule, or the user's function."""
    if config.lr_schedule in LR_SCHEDULES:
        return partial(_builtin_factor, config)
    return load_reference(config.lr_schedule, what="--lr-schedule")


def lr_at(step: int, config: TrainConfig) -> float:
    """Learning rate of 0-based `step`."""
    return config.lr * float(lr_factor(config)(step))


def check_optimizer_and_schedule(config: TrainConfig) -> None:
    """Import what the flags name, build the optimizer on a dummy parameter, call the schedule
    at step 0: an unknown keyword or a bad value costs one message before any rank starts."""
    try:
        make_optimizer(config, [nn.Parameter(torch.zeros(1))])
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        given = f" with --optimizer-args {config.optimizer_args}" if config.optimizer_args else ""
        cls = optimizer_spec(config)[0]
        takes = [
            n for n in inspect.signature(cls.__init__).parameters if n not in ("self", "params")
        ]
        raise ConfigError(
            f"--optimizer {config.optimizer}{given}: {exc} "
            f"({cls.__name__} takes {', '.join(takes)})"
        ) from None
    factor = lr_factor(config)
    try:
        value = factor(0)
    except Exception as exc:
        raise ConfigError(
            f"--lr-schedule {config.lr_schedule}: FN(0) raised {type(exc).__name__}: {exc}"
        ) from exc
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ConfigError(
            f"--lr-schedule {config.lr_schedule}: FN(step) must return a finite number (the "
            f"multiplier of --lr), FN(0) returned {value!r}"
        )
