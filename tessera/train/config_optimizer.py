"""The spelling checks of `--optimizer`, `--optimizer-args` and `--lr-schedule`, and where
`--grad-accum` applies: what the config checks of the optimizer before anything is built.

Its own module, below both `tessera.train.config` (which runs the check) and
`tessera.train.optimizers` (which builds what the flags name, from a `TrainConfig`): each
imports it one way, so neither needs the other to check a spelling. The import and the
construction of what the flags name are the preflight's (`optimizers.check_optimizer_and_schedule`).
"""

from __future__ import annotations

import json
from typing import Any

from tessera.errors import ConfigError
from tessera.strategies.registry import capabilities

__all__ = ["LR_SCHEDULES", "OPTIMIZERS", "check_optimizer_options", "parse_optimizer_args"]

OPTIMIZERS = ("adamw", "sgd")
LR_SCHEDULES = ("cosine", "linear", "constant")


def parse_optimizer_args(text: str | None) -> dict[str, Any]:
    """`--optimizer-args` as keyword arguments (JSON lists become tuples, as `betas` is)."""
    if text is None:
        return {}
    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--optimizer-args {text!r} is not valid JSON: {exc}") from None
    if not isinstance(values, dict):
        raise ConfigError(
            f"--optimizer-args must be a JSON object, e.g. '{{\"betas\": [0.9, 0.99]}}', "
            f"got {text!r}"
        )
    return {key: tuple(v) if isinstance(v, list) else v for key, v in values.items()}


def check_optimizer_options(config: Any) -> None:
    """The spelling of the optimizer and schedule flags of `config` (a `TrainConfig`), and
    where `grad_accum` applies."""
    from tessera.data.imports import is_reference  # (light: what a config check needs)

    if config.optimizer not in OPTIMIZERS and not is_reference(config.optimizer):
        raise ConfigError(
            f"unknown optimizer {config.optimizer!r}; choose one of {OPTIMIZERS} or give "
            "PKG.MODULE:CLASS"
        )
    parse_optimizer_args(config.optimizer_args)
    if config.lr_schedule not in LR_SCHEDULES and not is_reference(config.lr_schedule):
        raise ConfigError(
            f"unknown lr_schedule {config.lr_schedule!r}; choose one of {LR_SCHEDULES} or give "
            "PKG.MODULE:FN"
        )
    if config.grad_accum > 1 and not capabilities(config.strategy).grad_accum:
        raise ConfigError(
            f"grad_accum accumulates inside a tessera.setup engine; {config.strategy} workers push "
            "every gradient to the servers: use grad_accum 1"
        )
