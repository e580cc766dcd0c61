"""Small reference models (MLP, CNN, GPT) and a name -> model registry for configs and the CLI."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from tessera.models.cnn import CNN, CNNConfig
from tessera.models.gpt import GPT, GPTConfig
from tessera.models.mlp import MLP, MLPConfig

__all__ = [
    "CNN",
    "CNNConfig",
    "GPT",
    "GPTConfig",
    "MLP",
    "MLPConfig",
    "MODELS",
    "build_model",
]

# name -> (model class, config class); the model is built as ``cls(config_cls(**config_dict))``.
MODELS: dict[str, tuple[type[nn.Module], type]] = {
    "mlp": (MLP, MLPConfig),
    "cnn": (CNN, CNNConfig),
    "gpt": (GPT, GPTConfig),
}


def build_model(name: str, config_dict: dict[str, Any] | None = None) -> nn.Module:
    """Build the registered model ``name`` from a plain dict (e.g. parsed from JSON or the CLI).

    Unknown names and unknown config keys raise ``ValueError`` up front, naming the offender and
    the valid choices, rather than a ``TypeError`` from deep inside a dataclass constructor.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; valid names: {', '.join(sorted(MODELS))}")
    model_cls, config_cls = MODELS[name]
    config_dict = dict(config_dict or {})
    valid_keys = {field.name for field in dataclasses.fields(config_cls)}
    unknown = sorted(set(config_dict) - valid_keys)
    if unknown:
        raise ValueError(
            f"unknown config key(s) {', '.join(map(repr, unknown))} for model {name!r}; "
            f"valid keys: {', '.join(sorted(valid_keys))}"
        )
    missing = sorted(
        field.name
        for field in dataclasses.fields(config_cls)
        if field.default is dataclasses.MISSING
        and field.default_factory is dataclasses.MISSING
        and field.name not in config_dict
    )
    if missing:
        raise ValueError(f"missing required config key(s) {', '.join(missing)} for {name!r}")
    return model_cls(config_cls(**config_dict))
