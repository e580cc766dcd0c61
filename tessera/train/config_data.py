"""The `loader:` section of the training config (how a `--model` run reads its `--data`), and
the checks of evaluation and logging options.

Its own dataclass (flags `--num-workers`, `--epochs`, `--collate`, `--input-keys`,
`--target-keys`; YAML `loader: {num_workers: 2}`), checked here; `check_loader_options` checks
what depends on the rest of the config. The loader itself is `tessera.data.loader`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tessera.errors import ConfigError

__all__ = [
    "LOGGERS",
    "LoaderSettings",
    "check_eval_and_logging",
    "check_log_with",
    "check_loader_options",
    "log_with_names",
]

LOGGERS = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}
"""`--log-with` names and the package each needs (an optional extra: `tessera[NAME]`)."""


def _option(default: Any, help_text: str) -> Any:
    return field(default=default, metadata={"help": help_text})


@dataclass(kw_only=True, frozen=True)
class LoaderSettings:
    """How the items of --data become each step's batch."""

    num_workers: int = _option(
        -1,
        "Loader worker processes per rank fetching batches ahead of the step (DataLoader's "
        "num_workers); 0 fetches in the rank; -1: auto, the cores left per rank (at most 4).",
    )
    epochs: int = _option(
        0,
        "Train this many passes over --data instead of --steps (steps = epochs * items // "
        "(batch_size * grad_accum)); a fresh order every epoch. 0: --steps decides.",
    )
    collate: str | None = _option(
        None,
        "PKG.MODULE:FN: FN(list of items) -> batch, run in the loader workers (e.g. padding "
        "variable-length items); default: stack tensors.",
    )
    input_keys: str | None = _option(
        None,
        "Dict items: comma-separated keys passed to the model as keyword arguments "
        "(model(**inputs)); with --target-keys, loss(output, targets).",
    )
    target_keys: str | None = _option(
        None, "Dict items: the key (or comma-separated keys: a dict) of the loss's targets."
    )

    def __post_init__(self) -> None:
        if self.num_workers < -1:
            raise ConfigError(f"num_workers must be >= 0, or -1 (auto), got {self.num_workers}")
        if self.epochs < 0:
            raise ConfigError(f"epochs must not be negative, got {self.epochs}")
        if (self.input_keys is None) != (self.target_keys is None):
            raise ConfigError("--input-keys and --target-keys go together (both name dict keys)")


def check_loader_options(config: Any) -> None:
    """What the loader section needs of the rest of `config` (a TrainConfig)."""
    from tessera.data.imports import is_reference

    loader: LoaderSettings = config.loader
    given = [
        flag
        for flag, value in (
            ("--epochs", loader.epochs),
            ("--collate", loader.collate),
            ("--input-keys", loader.input_keys),
        )
        if value
    ]
    if given and config.model_factory is None:
        raise ConfigError(f"{given[0]} goes with --model: the demo GPT trains on --corpus")
    if loader.collate is not None and not is_reference(loader.collate):
        raise ConfigError(f"--collate {loader.collate!r} is not PKG.MODULE:FN")
    if loader.input_keys is not None and config.loss is None:
        raise ConfigError(
            "--input-keys/--target-keys call loss(output, targets): give --loss PKG.MODULE:FN"
        )


def log_with_names(value: str | None) -> list[str]:
    """`--log-with a,b` -> ["a", "b"]."""
    return [name.strip() for name in (value or "").split(",") if name.strip()]


def check_log_with(value: str | None) -> None:
    """Each `--log-with` name is known and its package importable (before any rank starts)."""
    import importlib.util

    for name in log_with_names(value):
        if name not in LOGGERS:
            raise ConfigError(
                f"log_with must be tensorboard, mlflow or wandb (comma-separated for several) "
                f"or unset, got {value!r}"
            )
        package = LOGGERS[name]
        if importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"--log-with {name} needs the {package} package: "
                f"pip install 'tessera[{name}]' (or pip install {package})"
            )


def check_eval_and_logging(config: Any) -> None:
    """--eval-every, --eval-batches and --log-with of `config` (a TrainConfig): values, held-out
    data, the package."""
    from tessera.strategies.registry import OWN_ENTRY_POINTS

    if config.eval_every < 0 or config.eval_batches < 0:
        raise ConfigError(
            f"eval_every must be >= 0 (0: no evaluation) and eval_batches >= 0, got "
            f"{config.eval_every} and {config.eval_batches}"
        )
    if config.eval_every and config.model_factory is not None and config.eval_data is None:
        raise ConfigError("--eval-every with --model needs --eval-data (the held-out set)")
    if (config.eval_every or config.log_with) and config.strategy in OWN_ENTRY_POINTS:
        raise ConfigError(
            f"--eval-every and --log-with: strategy {config.strategy} has its own loop"
        )
    check_log_with(config.log_with)  # tensorboard, mlflow, wandb: known, installed
