"""`strategy="single"`: one process, plain PyTorch (the `Engine` base itself).

Under several ranks every rank trains its own copy without communicating (the trainer refuses
that; from Python it is the per-rank reference the other strategies are compared with).
"""

from __future__ import annotations

from tessera.strategies.capabilities import Capabilities
from tessera.strategies.engine import Engine, NoOptions
from tessera.strategies.registry import declare_strategy

__all__ = ["NoOptions", "build"]

build = Engine
"""The `single` strategy's builder: an `Engine` over the whole model, the reference every
other strategy must equal."""

declare_strategy(
    "single",
    Engine,
    policy=NoOptions,
    capabilities=Capabilities(one_process=True, resume_any_world=True),
)
