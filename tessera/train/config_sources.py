"""Where a config's values come from besides flags: YAML files, the `--tp-plan` file, and the
world torchrun (or `tessera run`) started this process in. Checked with one clear error each."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from tessera.errors import ConfigError

__all__ = ["TP_STYLES", "job_world_size", "load_yaml", "read_tp_plan", "torchrun_world"]

TP_STYLES = ("column", "row", "embedding")


def read_tp_plan(path: str | Path) -> dict[str, str]:
    """The `--tp-plan` file: a JSON or YAML mapping {module-name pattern: column|row|embedding}."""
    plan = load_yaml(path)  # JSON is YAML
    for pattern, style in plan.items():
        if not isinstance(pattern, str) or style not in TP_STYLES:
            raise ConfigError(
                f"--tp-plan {path}: {pattern!r}: {style!r} is not one of {', '.join(TP_STYLES)}"
            )
    return plan


def torchrun_world() -> tuple[int, int] | None:
    """(WORLD_SIZE, LOCAL_WORLD_SIZE) in a worker of tessera run / torchrun, else None.

    tessera's own launcher also sets WORLD_SIZE, but with TESSERA_INIT_FILE beside it: a config
    built inside such a rank has the world it was launched with, nproc.
    """
    if "WORLD_SIZE" not in os.environ or "TESSERA_INIT_FILE" in os.environ:
        return None
    sizes = []
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        value = os.environ.get(name, os.environ["WORLD_SIZE"])
        try:
            sizes.append(int(value))
        except ValueError as exc:
            raise ConfigError(f"{name}={value!r} is not an integer") from exc
    return sizes[0], sizes[1]


def job_world_size(nproc: int) -> int:
    """How many ranks the job will have: torchrun's WORLD_SIZE in one of its workers, else nproc."""
    world = torchrun_world()
    return nproc if world is None else world[0]


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file into a dict, with a clear error for a missing or malformed one."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys to values")
    return data
