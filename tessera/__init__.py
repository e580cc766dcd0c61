"""tessera: distributed deep-learning training, every strategy in readable Python.

`import tessera` loads only the runtime (init, launch); the strategy packages (`tessera.zero`,
`tessera.pipeline`, ...) load on first use, so a tool that only reads a config or prints `--help`
does not pay for, or depend on, every engine.
"""

from __future__ import annotations

import importlib
from typing import Any

from tessera import errors
from tessera.runtime import Context, init, launch, shutdown

__all__ = [
    "Context",
    "DataParallel",
    "Engine",
    "Mesh",
    "comm",
    "data_parallel",
    "errors",
    "federated",
    "init",
    "launch",
    "memory",
    "optim",
    "parameter_server",
    "pipeline",
    "setup",
    "shutdown",
    "strategies",
    "tensor_parallel",
    "zero",
]
__version__ = "0.1.0"

_LAZY = {
    "comm": ("tessera.comm", None),
    "data_parallel": ("tessera.data_parallel", None),
    "federated": ("tessera.federated", None),
    "memory": ("tessera.memory", None),
    "optim": ("tessera.optim", None),
    "parameter_server": ("tessera.parameter_server", None),
    "pipeline": ("tessera.pipeline", None),
    "tensor_parallel": ("tessera.tensor_parallel", None),
    "zero": ("tessera.zero", None),
    "DataParallel": ("tessera.data_parallel", "DataParallel"),
    "Mesh": ("tessera.runtime.mesh", "Mesh"),
    "strategies": ("tessera.strategies", None),
    "setup": ("tessera.strategies.entry", "setup"),
    "Engine": ("tessera.strategies.engine", "Engine"),
}


def __getattr__(name: str) -> Any:
    """Load a strategy package or class on first access (PEP 562)."""
    if name not in _LAZY:
        raise AttributeError(f"module 'tessera' has no attribute {name!r}")
    module_name, attribute = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
