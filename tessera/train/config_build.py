"""Build a `TrainConfig` from layers of plain data (defaults < YAML < flags) and back.

Every value is type-checked against the field's annotation before the dataclass validates the
combination, so a wrong type names its key instead of failing somewhere in a rank.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from typing import Any

from tessera.errors import ConfigError
from tessera.train.config import TrainConfig

__all__ = ["AUTO_NPROC", "auto_nproc", "build_config", "config_to_dict"]


def _type_matches(value: Any, annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_type_matches(value, arm) for arm in typing.get_args(annotation))
    if origin is dict:
        return isinstance(value, dict)
    if annotation is type(None):
        return value is None
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, annotation)


AUTO_NPROC = "auto"
"""`--nproc auto`: one rank per GPU where CUDA is available, else one per CPU core."""


def auto_nproc(strategy: str | None) -> int:
    """The ranks `--nproc auto` starts: 1 for a strategy of one process (`single`), else the
    GPUs (CUDA under NCCL), else the cores (also with TESSERA_BACKEND=gloo, training on the CPU)."""
    from tessera.strategies.registry import STRATEGIES, capabilities

    if strategy in STRATEGIES and capabilities(strategy).one_process:
        return 1
    import torch  # only here: validating a config does not import torch otherwise

    from tessera.runtime.devices import uses_nccl  # (TESSERA_BACKEND=gloo: the CPU's cores)

    if uses_nccl():
        return torch.cuda.device_count()
    return os.cpu_count() or 1


def _resolve_nproc(values: dict[str, Any]) -> tuple[dict[str, Any], int | None]:
    """`nproc: auto` replaced by its number (returned too, for the error that names it)."""
    if values.get("nproc") != AUTO_NPROC:
        return values, None
    count = auto_nproc(values.get("strategy", TrainConfig.__dataclass_fields__["strategy"].default))
    return {**values, "nproc": count}, count


def _build(cls: type, values: dict[str, Any], where: str) -> Any:
    if not isinstance(values, dict):
        raise ConfigError(f"{where or 'config'} must be a mapping, got {type(values).__name__}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{where}{key}"
        if key not in known:
            raise ConfigError(f"unknown config key {name!r}; valid keys: {sorted(known)}")
        annotation = hints[key]
        if dataclasses.is_dataclass(annotation):
            value = _build(annotation, value, f"{name}.")
        elif not _type_matches(value, annotation):
            wanted = getattr(annotation, "__name__", str(annotation))
            raise ConfigError(f"config key {name!r} must be {wanted}, got {value!r}")
        elif annotation is float:
            value = float(value)
        kwargs[key] = value
    return cls(**kwargs)


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _current_names(layer: dict[str, Any]) -> dict[str, Any]:
    """`layer` with each renamed knob's former key (`config_knobs.RENAMED`) under its name, one
    deprecation line per former key; both in one layer: ConfigError (set it once)."""
    from tessera.train import config_knobs

    if not isinstance(layer, dict) or not set(layer) & set(config_knobs.RENAMED):
        return layer
    current = dict(layer)
    for old, new in config_knobs.RENAMED.items():
        if old in current:
            if new in current:
                raise ConfigError(f"config keys {old!r} and {new!r} are one knob: set {new!r}")
            config_knobs.warn_renamed(f"config key {old!r}", repr(new))
            current[new] = current.pop(old)
    return current


def build_config(*layers: dict[str, Any]) -> TrainConfig:
    """Merge config layers (later ones win, nested `model:` merged key by key) and validate.

    `nproc: auto` (or `--nproc auto`) becomes a number here, before any check, so the config
    (and config.yaml, which a resume reads) holds the world size the run had.
    """
    merged: dict[str, Any] = {}
    for layer in layers:
        merged = _merge(merged, _current_names(layer))
    merged, auto = _resolve_nproc(merged)
    try:
        return _build(TrainConfig, merged, "")
    except ConfigError as error:
        if auto is None:
            raise
        raise ConfigError(f"--nproc auto chose {auto} ranks: {error}") from None


def config_to_dict(config: TrainConfig) -> dict[str, Any]:
    """The config as plain data, for config.yaml and checkpoints: the run's own fields first,
    then the strategies' knobs (`TrainConfig` inherits those, so they come first as fields)."""
    data = dataclasses.asdict(config)
    knobs = {f.name for f in dataclasses.fields(config) if "policy" in f.metadata}
    return {
        **{key: value for key, value in data.items() if key not in knobs},
        **{key: value for key, value in data.items() if key in knobs},
    }
