"""`PKG.MODULE:NAME` references: how the trainer finds a user's model, data and loss factories.

The module is imported by name, with the current directory importable as `python -m` has it:
`tessera train --model mymodel:build` works with `mymodel.py` in the folder the command runs in,
even through the `tessera` console script (whose sys.path starts at its own bin folder). Every
rank resolves the same string again (ranks are fresh processes), so only the string travels in
the config and the checkpoint.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from typing import Any

from tessera.errors import ConfigError

__all__ = ["is_reference", "load_reference"]

_REFERENCE = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*")


def is_reference(spec: str) -> bool:
    """Whether `spec` reads as `PKG.MODULE:NAME` (dotted module, colon, dotted attribute)."""
    return _REFERENCE.fullmatch(spec) is not None


def _importable_cwd() -> None:
    """Put the current directory on sys.path (last: installed packages keep precedence)."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


def load_reference(spec: str, *, what: str) -> Any:
    """The callable `PKG.MODULE:NAME` names; `what` (e.g. "--model") prefixes every error.

    Raises ConfigError, naming the reference, when it is malformed, its module cannot be
    imported (missing, or raising while imported), the attribute is missing or not callable.
    """
    if not is_reference(spec):
        raise ConfigError(f"{what} {spec!r} is not PKG.MODULE:NAME (e.g. mypkg.models:build)")
    module_name, _, attribute = spec.partition(":")
    _importable_cwd()
    try:
        target: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name):
            raise ConfigError(
                f"{what} {spec!r}: no module named {exc.name!r} (searched the current directory "
                "and sys.path; add its folder to PYTHONPATH)"
            ) from None
        raise ConfigError(f"{what} {spec!r}: importing {module_name} failed: {exc}") from exc
    except Exception as exc:  # the user's module raised while being imported
        raise ConfigError(
            f"{what} {spec!r}: importing {module_name} failed: {type(exc).__name__}: {exc}"
        ) from exc
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"{what} {spec!r}: {module_name} has no attribute {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"{what} {spec!r} is a {type(target).__name__}, not a callable")
    return target
