"""The training loop, its config, strategies, metrics and checkpoints."""

from tessera.train.checkpoint import load_checkpoint, save_checkpoint
from tessera.train.config import ModelSettings, TrainConfig, build_config, load_yaml
from tessera.train.run import run_training
from tessera.train.strategy import STRATEGIES, Engine, TorchDDPEngine, register_strategy

__all__ = [
    "STRATEGIES",
    "Engine",
    "ModelSettings",
    "TorchDDPEngine",
    "TrainConfig",
    "build_config",
    "load_checkpoint",
    "load_yaml",
    "register_strategy",
    "run_training",
    "save_checkpoint",
]
