"""One entry point for every strategy: `setup(model, optimizer, strategy=...) -> Engine`.

The Engine protocol (`engine.py`), the batch rule (`batch.py`), the registry of strategy names
(`registry.py`) and one small adapter per strategy, each building an Engine from the strategy
libraries below (`tessera.data_parallel`, `tessera.zero`, `tessera.pipeline`, ...) and declaring
its strategy there (`registry.declare_strategy`). Names load on first use (PEP 562): importing
the registry alone imports neither torch.distributed nor any strategy library; its first lookup
imports the adapters, where the strategies are declared.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "STRATEGIES",
    "Capabilities",
    "Engine",
    "StepLoss",
    "NoOptions",
    "OptimizerFactory",
    "compute_loss",
    "gather_batch",
    "make_policy",
    "policy_class",
    "register_strategy",
    "setup",
    "split_microbatches",
]

_LAZY = {
    "STRATEGIES": "tessera.strategies.registry",
    "Capabilities": "tessera.strategies.capabilities",
    "policy_class": "tessera.strategies.registry",
    "register_strategy": "tessera.strategies.registry",
    "Engine": "tessera.strategies.engine",
    "StepLoss": "tessera.strategies.step_loss",
    "NoOptions": "tessera.strategies.engine",
    "OptimizerFactory": "tessera.strategies.engine",
    "compute_loss": "tessera.strategies.batch",
    "gather_batch": "tessera.strategies.batch",
    "split_microbatches": "tessera.strategies.batch",
    "make_policy": "tessera.strategies.entry",
    "setup": "tessera.strategies.entry",
}


def __getattr__(name: str) -> Any:
    """Load a name of the package on first access."""
    if name not in _LAZY:
        raise AttributeError(f"module 'tessera.strategies' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
