"""Names of a package loaded on first use (PEP 562), so importing one of its modules (a strategy
library's `policy`, as `tessera train`'s config does) does not import the rest."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_names"]


def lazy_names(
    package: str, names: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """`(__getattr__, __dir__)` for `package`: each of `names` (name -> module) loads from its
    module on first access, as does any module of the package named as an attribute."""

    def __getattr__(name: str) -> Any:
        if name in names:
            value = getattr(importlib.import_module(names[name]), name)
        else:
            try:
                value = importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as exc:
                if exc.name != f"{package}.{name}":
                    raise  # a module of the package that failed to import: its own error
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        vars(sys.modules[package])[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *names})

    return __getattr__, __dir__
