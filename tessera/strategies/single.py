"""`strategy="single"`: one process, plain PyTorch (the `Engine` base itself).

Under several ranks every rank trains its own copy without communicating (the trainer refuses
that; from Python it is the per-rank reference the other strategies are compared with).
"""

from __future__ import annotations

from tessera.strategies.engine import Engine, NoOptions

__all__ = ["NoOptions", "build"]

build = Engine
"""The `single` strategy's builder: an `Engine` over the whole model, the reference every
other strategy must equal."""
