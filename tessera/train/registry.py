"""Strategy names and where their engines live, loaded only when an engine is built.

`tessera train --strategy NAME` and `TrainConfig` need the list of names; only the process that
builds an engine needs the engine's code (and with it torch.distributed, the collectives, the
pipeline runner...). So the registry stores tessera's own strategies as "module:attribute"
strings and imports one when it is looked up: validating a config, or printing `--help`, imports
no engine, and the engine modules import `tessera.train.strategy` (their base class) without
that module importing them back. Users add their own with `register_strategy(name)`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

__all__ = [
    "OWN_ENTRY_POINTS",
    "STRATEGIES",
    "own_entry_point",
    "register_strategy",
    "strategy_names",
]

BUILTIN_STRATEGIES: dict[str, str] = {
    "single": "tessera.train.strategy:Engine",
    "torch-ddp": "tessera.train.strategy:TorchDDPEngine",
    "ddp": "tessera.data_parallel.engine:DDPEngine",
    "local-sgd": "tessera.data_parallel.engine:LocalSGDEngine",
    "zero1": "tessera.zero.engine:Zero1Engine",
    "zero2": "tessera.zero.engine:Zero2Engine",
    "zero3": "tessera.zero.engine:Zero3Engine",
    "pipeline": "tessera.pipeline.engine:pipeline_strategy",
    "tensor": "tessera.pipeline.engine:tensor_strategy",
    "hybrid": "tessera.pipeline.engine:hybrid_strategy",
}
"""tessera's strategies: name -> "module:attribute" of the factory (an Engine class or function)."""

OWN_ENTRY_POINTS: dict[str, str] = {
    "ps": "tessera.parameter_server.train:train_ps",
}
"""Strategies whose ranks play different roles (parameter servers and workers), so no `Engine`
run alike on every rank fits them: `run_training` hands them the whole job,
`entry(config, run_dir, resume) -> summary`. They have no resume test in test_resume.py's table;
each has its own (tests/test_parameter_server_train.py)."""

_user_strategies: dict[str, Callable[..., Any]] = {}


def _load(target: str) -> Callable[..., Any]:
    module_name, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module_name), attribute)


def own_entry_point(name: str) -> Callable[..., Any] | None:
    """The entry point of strategy `name` if it runs the job itself, else None."""
    return _load(OWN_ENTRY_POINTS[name]) if name in OWN_ENTRY_POINTS else None


def strategy_names() -> list[str]:
    """Every strategy name, sorted (imports no engine)."""
    return sorted({*BUILTIN_STRATEGIES, *_user_strategies})


def register_strategy(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Class or function decorator adding a strategy under `name`.

    A strategy is `factory(module, make_optimizer, ctx, config) -> Engine`; see
    `tessera.train.strategy`. A name is registered once: reusing one raises ValueError.
    """

    def add(factory: Callable[..., Any]) -> Callable[..., Any]:
        if name in BUILTIN_STRATEGIES or name in OWN_ENTRY_POINTS or name in _user_strategies:
            raise ValueError(f"strategy {name!r} is registered twice")
        _user_strategies[name] = factory
        return factory

    return add


class _StrategyTable(Mapping[str, Callable[..., Any]]):
    """Read-only name -> factory view; looking a name up imports its module, listing does not."""

    def __getitem__(self, name: str) -> Callable[..., Any]:
        if name in _user_strategies:
            return _user_strategies[name]
        if name in BUILTIN_STRATEGIES:
            return _load(BUILTIN_STRATEGIES[name])
        raise KeyError(f"unknown strategy {name!r}; choose one of {strategy_names()}")

    def __contains__(self, name: object) -> bool:
        return name in BUILTIN_STRATEGIES or name in _user_strategies

    def __iter__(self) -> Iterator[str]:
        return iter(strategy_names())

    def __len__(self) -> int:
        return len(strategy_names())

    def __repr__(self) -> str:
        return f"STRATEGIES({strategy_names()})"


STRATEGIES: Mapping[str, Callable[..., Any]] = _StrategyTable()
"""Strategy name -> factory; `tessera train --strategy NAME` picks from these."""
