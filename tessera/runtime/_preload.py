"""Imported once by the fork server that `tessera.launch` starts its ranks from.

What every rank would otherwise import on its own, seconds each on a small machine: torch, the
trainer, the engines, torch's compiler front end (the first optimizer built imports it) and the
plotting library of the summary. Nothing here runs a torch operation or starts a thread, so a
process forked from the server is as clean as a fresh one.
"""

from __future__ import annotations

import importlib

_MODULES = (
    "torch",
    "torch._dynamo",
    "torch.distributed",
    "tessera.train.loop",
    "tessera.strategies.ddp",
    "tessera.strategies.zero",
    "tessera.strategies.pipeline",
    "tessera.strategies.tensor",
    "tessera.parameter_server.api",
)

for _name in _MODULES:
    importlib.import_module(_name)

import matplotlib  # noqa: E402 - the backend is chosen before pyplot loads

matplotlib.use("Agg")
importlib.import_module("matplotlib.pyplot")
