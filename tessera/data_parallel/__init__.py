"""Data parallelism: tessera's DDP engine (buckets, hooks, overlap), compression, local SGD.

Names load on first use (PEP 562): importing one module of the package (its `policy`, as
`tessera train`'s config does) does not import the rest.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "Bucket",
    "DDPPolicy",
    "DataParallel",
    "LocalSGDPolicy",
    "PowerSGD",
    "TorchDDPPolicy",
    "assign_buckets",
    "average_gradients",
    "average_parameters",
    "cast_hook",
]

_LAZY = {
    "Bucket": "tessera.data_parallel.bucket",
    "DDPPolicy": "tessera.data_parallel.policy",
    "DataParallel": "tessera.data_parallel.ddp",
    "LocalSGDPolicy": "tessera.data_parallel.policy",
    "PowerSGD": "tessera.data_parallel.compression",
    "TorchDDPPolicy": "tessera.data_parallel.policy",
    "assign_buckets": "tessera.data_parallel.bucket",
    "average_gradients": "tessera.data_parallel.naive",
    "average_parameters": "tessera.data_parallel.naive",
    "cast_hook": "tessera.data_parallel.compression",
}


def __getattr__(name: str) -> Any:
    """Load a name of the package (or one of its modules) on first access."""
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    else:
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise  # a module of the package that failed to import: its own error
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
