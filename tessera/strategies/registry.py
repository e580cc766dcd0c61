"""Strategy names, their builders, policies and declarations: found in the adapters, and users'.

Each of tessera's strategies is declared in its adapter file (`tessera/strategies/zero.py`...)
by one `declare_strategy(name, build, policy=..., capabilities=...)` call: its name, its
`Engine` class (or, for a strategy whose ranks play different roles, the entry point that runs
the whole job), its policy dataclass (its knobs, each declared on its field:
`tessera.strategies.knobs`) and what it can do (`Capabilities`: resume on another world size,
elastic restarts, its rank layout...), whose `options` (the trainer knobs it takes) are derived
from the policy. The registry finds the declarations by importing every module of
`tessera.strategies` once, on the first lookup: adding a built-in strategy touches its library,
its policy and its adapter file, never this one. That import costs about half a second after
torch (the adapters import their libraries, not torch's pipelining, which loads when a model is
traced); importing this module alone imports none of them. Users add strategies with
`register_strategy(name, policy=...)`. The trainer reads the declarations and never a
strategy's name.

A builder is an `Engine` class (or a function like one):
`build(model, optimizer_factory, ctx, *, policy, **steps) -> Engine`, where `steps` are the
`Engine` constructor's cross-cutting keywords (loss_fn, grad_clip, grad_accum, precision,
loss_scaler, batch_keys, strategy_name), which a subclass hands on to `Engine.__init__`: the
engine is whole when built. A policy is a frozen dataclass whose fields are the strategy's
options (`tessera.setup`'s keywords).
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Generic, TypeVar

from tessera.errors import ConfigError
from tessera.strategies.capabilities import Capabilities
from tessera.strategies.knobs import options_of

__all__ = [
    "BUILTIN_STRATEGIES",
    "CAPABILITIES",
    "Capabilities",
    "Declared",
    "NOT_COMPILABLE",
    "OWN_ENTRY_POINTS",
    "STRATEGIES",
    "builtin_policies",
    "capabilities",
    "check_compile",
    "declare_strategy",
    "offered_by",
    "own_entry_point",
    "policy_class",
    "register_strategy",
    "strategy_names",
    "user_policies",
]

_ADAPTERS = "tessera.strategies"
"""The package whose modules declare tessera's strategies."""


@dataclasses.dataclass(frozen=True)
class Declared:
    """One of tessera's strategies, as its adapter file declares it."""

    name: str
    build: Callable[..., Any]
    """Its `Engine` class (or builder); or, `own_job`, its entry point
    `entry(config, run_dir, resume, tools) -> summary`."""
    policy: type
    """The frozen dataclass of its options."""
    capabilities: Capabilities
    """What it can do; `options` derived from `policy`."""
    own_job: bool = False
    """Its ranks play different roles (parameter servers and workers), so no `Engine` run alike
    on every rank fits it: the trainer hands it the whole job, with `tools` the trainer's
    functions it calls (`tessera.strategies.own_job.JobTools`)."""


_declared: dict[str, Declared] = {}
_discovered = False


def declare_strategy(
    name: str,
    build: Callable[..., Any],
    *,
    policy: type,
    capabilities: Capabilities | None = None,
    leaving_out: Iterable[str] = (),
    own_job: bool = False,
) -> None:
    """Declare one of tessera's strategies (called at the bottom of its adapter file).

    `capabilities`' `options` are derived from `policy`'s fields (`knobs.options_of`), less
    `leaving_out` (knobs of the policy this strategy does not take). A name is declared once.
    """
    if name in _declared:
        raise ValueError(f"strategy {name!r} is declared twice")
    caps = capabilities or Capabilities()
    caps = dataclasses.replace(caps, options=options_of(policy, leaving_out=leaving_out))
    _declared[name] = Declared(name, build, policy, caps, own_job)


def _builtins() -> dict[str, Declared]:
    """Every declared strategy, importing each module of `tessera.strategies` on first use."""
    global _discovered
    if not _discovered:
        _discovered = True  # (set first: an adapter's import may look a name up)
        try:
            package = importlib.import_module(_ADAPTERS)
            for module in pkgutil.iter_modules(package.__path__, _ADAPTERS + "."):
                importlib.import_module(module.name)
        except BaseException:
            _discovered = False
            raise
    return _declared


def _engines() -> dict[str, Declared]:
    return {name: entry for name, entry in _builtins().items() if not entry.own_job}


def _owns() -> dict[str, Declared]:
    return {name: entry for name, entry in _builtins().items() if entry.own_job}


def _target(obj: Any) -> str:
    return f"{obj.__module__}:{obj.__qualname__}"


V = TypeVar("V")


class _Derived(Mapping[str, V], Generic[V]):
    """A read-only view of the declarations, read when first used (listing the adapters imports
    them): name -> `value(declaration)` of those `keep` selects."""

    def __init__(self, keep: Callable[[Declared], bool], value: Callable[[Declared], V]) -> None:
        self._keep, self._value = keep, value

    def _read(self) -> dict[str, V]:
        return {n: self._value(d) for n, d in _builtins().items() if self._keep(d)}

    def __getitem__(self, name: str) -> V:
        return self._read()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._read())

    def __len__(self) -> int:
        return len(self._read())

    def __repr__(self) -> str:
        return repr(self._read())


BUILTIN_STRATEGIES: Mapping[str, tuple[str, str]] = _Derived(
    lambda d: not d.own_job,
    lambda d: (_target(d.build), _target(d.policy)),
)
"""tessera's Engine strategies: name -> ("module:EngineClass", "module:PolicyClass")."""

OWN_ENTRY_POINTS: Mapping[str, str] = _Derived(
    lambda d: d.own_job,
    lambda d: _target(d.build),
)
"""Strategies whose ranks play different roles (parameter servers and workers), so no `Engine`
run alike on every rank fits them: the trainer hands them the whole job,
`entry(config, run_dir, resume, tools) -> summary`, `tools` the trainer's functions they call
(`tessera.strategies.own_job.JobTools`)."""

CAPABILITIES: Mapping[str, Capabilities] = _Derived(
    lambda d: True,
    lambda d: d.capabilities,
)
"""What each of tessera's strategies can do (`Capabilities`), as its adapter file declares it;
a user's strategy declares its own (`register_strategy`)."""

NOT_COMPILABLE: Mapping[str, str] = _Derived(
    lambda d: bool(d.capabilities.not_compilable),
    lambda d: d.capabilities.not_compilable or "",
)
"""Strategies under which `tessera train --compile` (torch.compile of the model) is refused, and
why (from their `Capabilities`); the others (single, ddp, torch-ddp, local-sgd, zero1, zero2)
keep the module whole and hook only its gradients, which a compiled module leaves to eager
autograd, as they are."""


def check_compile(strategy: str, compile: bool) -> None:
    """`--compile` under `strategy`: ConfigError with the reason where it cannot be done."""
    reason = capabilities(strategy).not_compilable if compile else None
    if reason:
        raise ConfigError(f"--compile is not supported by --strategy {strategy}: {reason}")


_user_strategies: dict[str, tuple[Callable[..., Any], type, Capabilities]] = {}


def own_entry_point(name: str) -> Callable[..., Any] | None:
    """The entry point of strategy `name` if it runs the job itself, else None."""
    entry = _owns().get(name)
    return None if entry is None else entry.build


def strategy_names() -> list[str]:
    """Every Engine strategy name, sorted."""
    return sorted({*_engines(), *_user_strategies})


def _unknown(name: str) -> KeyError:
    return KeyError(f"unknown strategy {name!r}; choose one of {strategy_names()}")


def policy_class(name: str) -> type:
    """The policy dataclass of strategy `name` (its options)."""
    if name in _user_strategies:
        return _user_strategies[name][1]
    if name in _builtins():
        return _builtins()[name].policy
    raise _unknown(name)


def builtin_policies() -> list[type]:
    """The policy class of each of tessera's strategies, once each: the homes of the trainer's
    knobs (`tessera.strategies.knobs`)."""
    return list(dict.fromkeys(entry.policy for entry in _builtins().values()))


def register_strategy(
    name: str, *, policy: type | None = None, capabilities: Capabilities | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator adding a strategy `name` built by the decorated function (or Engine class).

    It is called as `build(model, optimizer_factory, ctx, *, policy, **steps)` (an `Engine`
    subclass takes `steps`, the cross-cutting keywords, as they are) and returns an `Engine`;
    `policy` is the frozen dataclass of its options (default: none): each of its fields is also
    a `tessera train` option (`--FIELD`, YAML `options: {FIELD: ...}`). What it can do
    (`Capabilities`: resume on another world size, elastic restarts, ...) comes from
    `capabilities`, else a `capabilities` attribute of the policy class or of the decorated
    Engine class, else the defaults (none of those). A name is registered once: reusing one
    raises ValueError.
    """
    if policy is None:
        from tessera.strategies.engine import NoOptions

        policy = NoOptions

    def add(factory: Callable[..., Any]) -> Callable[..., Any]:
        if name in _builtins() or name in _user_strategies:
            raise ValueError(f"strategy {name!r} is registered twice")
        declared = capabilities or _declared_on(policy) or _declared_on(factory) or Capabilities()
        _user_strategies[name] = (factory, policy, declared)
        return factory

    return add


def _declared_on(owner: Any) -> Capabilities | None:
    found = getattr(owner, "capabilities", None)
    return found if isinstance(found, Capabilities) else None


def capabilities(name: str) -> Capabilities:
    """What strategy `name` (tessera's, a parameter-server-like entry point, or a user's) can do."""
    if name in _user_strategies:
        return _user_strategies[name][2]
    if name in _builtins():
        return _builtins()[name].capabilities
    raise _unknown(name)


def offered_by(knob: str) -> list[str]:
    """The strategies that take trainer knob `knob`, sorted (for messages that list them)."""
    names = [*strategy_names(), *OWN_ENTRY_POINTS]
    return sorted(name for name in names if capabilities(name).takes(knob))


def user_policies() -> dict[str, type]:
    """The policy class of each strategy added with `register_strategy` (their knobs become
    `tessera train` options)."""
    return {name: entry[1] for name, entry in _user_strategies.items()}


class _StrategyTable(Mapping[str, Callable[..., Any]]):
    """Read-only name -> builder view of tessera's Engine strategies and users'."""

    def __getitem__(self, name: str) -> Callable[..., Any]:
        if name in _user_strategies:
            return _user_strategies[name][0]
        if name in _engines():
            return _engines()[name].build
        raise _unknown(name)

    def __contains__(self, name: object) -> bool:
        return name in _engines() or name in _user_strategies

    def __iter__(self) -> Iterator[str]:
        return iter(strategy_names())

    def __len__(self) -> int:
        return len(strategy_names())

    def __repr__(self) -> str:
        return f"STRATEGIES({strategy_names()})"


STRATEGIES: Mapping[str, Callable[..., Any]] = _StrategyTable()
"""Strategy name -> builder; `tessera.setup(strategy=NAME)` and `tessera train` pick from these."""
