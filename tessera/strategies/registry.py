"""Strategy names, where their builders and policies live, loaded only when used.

`tessera train --strategy NAME` and its config need the list of names; only a process that
builds an engine needs the engine's code (and with it torch.distributed, the collectives, the
pipeline runner...). So tessera's own strategies are "module:attribute" strings, imported when
looked up: listing names or printing `--help` imports no engine. Users add theirs with
`register_strategy(name, policy=...)`.

A builder is `build(model, optimizer_factory, ctx, *, loss_fn, grad_clip, policy) -> Engine`;
a policy is a frozen dataclass whose fields are the strategy's options (`tessera.setup`'s
keywords).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from tessera.errors import ConfigError

__all__ = [
    "BUILTIN_STRATEGIES",
    "NOT_COMPILABLE",
    "OWN_ENTRY_POINTS",
    "STRATEGIES",
    "check_compile",
    "own_entry_point",
    "policy_class",
    "register_strategy",
    "strategy_names",
]

_NO_OPTIONS = "tessera.strategies.engine:NoOptions"

BUILTIN_STRATEGIES: dict[str, tuple[str, str]] = {
    "single": ("tessera.strategies.single:build", _NO_OPTIONS),
    "torch-ddp": (
        "tessera.strategies.torch_ddp:build",
        "tessera.data_parallel.policy:TorchDDPPolicy",
    ),
    "ddp": ("tessera.strategies.ddp:build_ddp", "tessera.data_parallel.policy:DDPPolicy"),
    "local-sgd": (
        "tessera.strategies.ddp:build_local_sgd",
        "tessera.data_parallel.policy:LocalSGDPolicy",
    ),
    "zero1": ("tessera.strategies.zero:build_zero1", "tessera.zero.policy:ZeroPolicy"),
    "zero2": ("tessera.strategies.zero:build_zero2", "tessera.zero.policy:ZeroPolicy"),
    "zero3": ("tessera.strategies.zero:build_zero3", "tessera.zero.policy:ZeroPolicy"),
    "pipeline": (
        "tessera.strategies.pipeline:build_pipeline",
        "tessera.pipeline.policy:PipelinePolicy",
    ),
    "tensor": (
        "tessera.strategies.tensor:build_tensor",
        "tessera.tensor_parallel.policy:TensorPolicy",
    ),
    "hybrid": ("tessera.strategies.pipeline:build_hybrid", "tessera.pipeline.policy:HybridPolicy"),
}
"""tessera's strategies: name -> ("module:builder", "module:PolicyClass")."""

OWN_ENTRY_POINTS: dict[str, str] = {
    "ps": "tessera.strategies.ps:train_ps",
}
"""Strategies whose ranks play different roles (parameter servers and workers), so no `Engine`
run alike on every rank fits them: the trainer hands them the whole job,
`entry(config, run_dir, resume, tools) -> summary`, `tools` the trainer's functions they call
(`tessera.strategies.own_job.JobTools`)."""

NOT_COMPILABLE: dict[str, str] = {
    "zero3": "its module hooks gather and free each parameter's storage around every forward",
    "pipeline": "it cuts the model into stages by running its modules one by one",
    "hybrid": "it cuts the model into stages by running its modules one by one",
    "tensor": "its sharded layers issue collectives inside forward and backward",
    "ps": "its workers run their own loop against the parameter servers",
}
"""Strategies under which `tessera train --compile` (torch.compile of the model) is refused, and
why; the others (single, ddp, torch-ddp, local-sgd, zero1, zero2) keep the module whole and
hook only its gradients, which a compiled module leaves to eager autograd, as they are."""



def check_compile(strategy: str, compile: bool) -> None:
    """`--compile` under `strategy`: ConfigError with the reason where it cannot be done."""
    if compile and strategy in NOT_COMPILABLE:
        raise ConfigError(
            f"--compile is not supported by --strategy {strategy}: {NOT_COMPILABLE[strategy]}"
        )


_user_strategies: dict[str, tuple[Callable[..., Any], type]] = {}


def _load(target: str) -> Any:
    module_name, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module_name), attribute)


def own_entry_point(name: str) -> Callable[..., Any] | None:
    """The entry point of strategy `name` if it runs the job itself, else None."""
    return _load(OWN_ENTRY_POINTS[name]) if name in OWN_ENTRY_POINTS else None


def strategy_names() -> list[str]:
    """Every Engine strategy name, sorted (imports no engine)."""
    return sorted({*BUILTIN_STRATEGIES, *_user_strategies})


def _unknown(name: str) -> KeyError:
    return KeyError(f"unknown strategy {name!r}; choose one of {strategy_names()}")


def policy_class(name: str) -> type:
    """The policy dataclass of strategy `name` (its options)."""
    if name in _user_strategies:
        return _user_strategies[name][1]
    if name in BUILTIN_STRATEGIES:
        return _load(BUILTIN_STRATEGIES[name][1])
    raise _unknown(name)


def register_strategy(
    name: str, *, policy: type | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator adding a strategy `name` built by the decorated function (or Engine class).

    It is called as `build(model, optimizer_factory, ctx, *, loss_fn, grad_clip, policy)` and
    returns an `Engine`; `policy` is the frozen dataclass of its options (default: none). A name
    is registered once: reusing one raises ValueError.
    """
    if policy is None:
        policy = _load(_NO_OPTIONS)

    def add(factory: Callable[..., Any]) -> Callable[..., Any]:
        if name in BUILTIN_STRATEGIES or name in OWN_ENTRY_POINTS or name in _user_strategies:
            raise ValueError(f"strategy {name!r} is registered twice")
        _user_strategies[name] = (factory, policy)
        return factory

    return add


class _StrategyTable(Mapping[str, Callable[..., Any]]):
    """Read-only name -> builder view; looking a name up imports its module, listing does not."""

    def __getitem__(self, name: str) -> Callable[..., Any]:
        if name in _user_strategies:
            return _user_strategies[name][0]
        if name in BUILTIN_STRATEGIES:
            return _load(BUILTIN_STRATEGIES[name][0])
        raise _unknown(name)

    def __contains__(self, name: object) -> bool:
        return name in BUILTIN_STRATEGIES or name in _user_strategies

    def __iter__(self) -> Iterator[str]:
        return iter(strategy_names())

    def __len__(self) -> int:
        return len(strategy_names())

    def __repr__(self) -> str:
        return f"STRATEGIES({strategy_names()})"


STRATEGIES: Mapping[str, Callable[..., Any]] = _StrategyTable()
"""Strategy name -> builder; `tessera.setup(strategy=NAME)` and `tessera train` pick from these."""
