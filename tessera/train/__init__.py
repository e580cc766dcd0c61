"""The training loop, its config, metrics and checkpoints, on top of `tessera.strategies`.

The config and the strategy registry (`tessera.strategies.registry`, re-exported here with
`register_strategy`) load eagerly: the config's strategy knobs are generated from the strategies'
policies, which the registry finds declared in the adapters (importing them costs about half a
second after torch; torch's pipelining loads only when a model is traced); the loop loads on
first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from tessera.strategies.registry import STRATEGIES, register_strategy
from tessera.train.config import ModelSettings, TrainConfig, load_yaml
from tessera.train.config_build import build_config

__all__ = [
    "STRATEGIES",
    "Callback",
    "Engine",
    "ModelSettings",
    "TorchDDPEngine",
    "TrainConfig",
    "build_config",
    "load_checkpoint",
    "latest_checkpoint",
    "load_yaml",
    "register_strategy",
    "run_training",
    "save_checkpoint",
    "StopTraining",
]

_LAZY = {
    "Callback": "tessera.train.callbacks",
    "StopTraining": "tessera.train.callbacks",
    "Engine": "tessera.strategies.engine",
    "TorchDDPEngine": "tessera.strategies.torch_ddp",
    "latest_checkpoint": "tessera.checkpoint.series",
    "load_checkpoint": "tessera.checkpoint.files",
    "save_checkpoint": "tessera.checkpoint.files",
    "run_training": "tessera.train.run",
}


def __getattr__(name: str) -> Any:
    """Load the loop, the engines' base class and checkpoints on first access (PEP 562)."""
    if name not in _LAZY:
        raise AttributeError(f"module 'tessera.train' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
