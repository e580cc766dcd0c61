"""Strategy names, where their builders and policies live, loaded only when used.

`tessera train --strategy NAME` and its config need the list of names; only a process that
builds an engine needs the engine's code (and with it torch.distributed, the collectives, the
pipeline runner...). So tessera's own strategies are "module:attribute" strings, imported when
looked up: listing names or printing `--help` imports no engine. Users add theirs with
`register_strategy(name, policy=...)`. What each strategy can do (`Capabilities`: the trainer
knobs it takes, resume on another world size, elastic restarts, its rank layout...) is declared
here for tessera's own, and by a user's strategy on its policy or Engine class: the trainer reads
the declaration and never a strategy's name.

A builder is an `Engine` class (or a function like one):
`build(model, optimizer_factory, ctx, *, policy, **steps) -> Engine`, where `steps` are the
`Engine` constructor's cross-cutting keywords (loss_fn, grad_clip, grad_accum, precision,
loss_scaler, batch_keys, strategy_name), which a subclass hands on to `Engine.__init__`: the
engine is whole when built. A policy is a frozen dataclass whose fields are the strategy's
options (`tessera.setup`'s keywords).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from tessera.errors import ConfigError
from tessera.strategies.capabilities import (
    Capabilities,
    hybrid_layout,
    pipeline_layout,
    tensor_layout,
)
from tessera.strategies.knobs import options_of_named

__all__ = [
    "BUILTIN_STRATEGIES",
    "CAPABILITIES",
    "Capabilities",
    "NOT_COMPILABLE",
    "OWN_ENTRY_POINTS",
    "STRATEGIES",
    "builtin_policies",
    "capabilities",
    "check_compile",
    "offered_by",
    "own_entry_point",
    "policy_class",
    "register_strategy",
    "strategy_names",
    "user_policies",
]

_NO_OPTIONS = "tessera.strategies.engine:NoOptions"

BUILTIN_STRATEGIES: dict[str, tuple[str, str]] = {
    "single": ("tessera.strategies.engine:Engine", _NO_OPTIONS),
    "torch-ddp": (
        "tessera.strategies.torch_ddp:TorchDDPEngine",
        "tessera.data_parallel.policy:TorchDDPPolicy",
    ),
    "ddp": ("tessera.strategies.ddp:DDPEngine", "tessera.data_parallel.policy:DDPPolicy"),
    "local-sgd": (
        "tessera.strategies.ddp:LocalSGDEngine",
        "tessera.data_parallel.policy:LocalSGDPolicy",
    ),
    "zero1": ("tessera.strategies.zero:Zero1Engine", "tessera.zero.policy:ZeroPolicy"),
    "zero2": ("tessera.strategies.zero:Zero2Engine", "tessera.zero.policy:ZeroPolicy"),
    "zero3": ("tessera.strategies.zero:Zero3Engine", "tessera.zero.policy:ZeroPolicy"),
    "pipeline": (
        "tessera.strategies.pipeline:PipelineEngine",
        "tessera.pipeline.policy:PipelinePolicy",
    ),
    "tensor": (
        "tessera.strategies.tensor:TensorEngine",
        "tessera.tensor_parallel.policy:TensorPolicy",
    ),
    "hybrid": (
        "tessera.strategies.pipeline:PipelineEngine",
        "tessera.pipeline.policy:HybridPolicy",
    ),
}
"""tessera's strategies: name -> ("module:EngineClass", "module:PolicyClass")."""

OWN_ENTRY_POINTS: dict[str, str] = {
    "ps": "tessera.strategies.ps:train_ps",
}
"""Strategies whose ranks play different roles (parameter servers and workers), so no `Engine`
run alike on every rank fits them: the trainer hands them the whole job,
`entry(config, run_dir, resume, tools) -> summary`, `tools` the trainer's functions they call
(`tessera.strategies.own_job.JobTools`)."""

_OWN_POLICIES: dict[str, str] = {"ps": "tessera.parameter_server.options:PSPolicy"}
"""The policy (its knobs) of each strategy that runs the job itself."""

_ZERO_1_2 = options_of_named(BUILTIN_STRATEGIES["zero1"][1], leaving_out=("offload_params",))
"""ZeRO's knobs (the offload group folded into its `offload`) but ZeRO-3's `offload_params`."""
_SPLITS_STAGES = "it cuts the model into stages by running its modules one by one"
_SPLIT_BY_STAGE = "its optimizer state is split by pipeline stage"
_OWN_SPLIT = {"activation_checkpointing": False, "frees_gradients": True}
"""Model-parallel engines: they split the GPT their own way (no whole-model activation
checkpointing), and their gradients are freed after each step."""


def _ps_world(config: Any, world_size: int | None) -> None:
    """The parameter server's job: servers + workers processes, whatever nproc says."""
    from tessera.parameter_server.options import check_ps_options

    check_ps_options(
        servers=config.servers,
        workers=config.workers,
        consistency=config.consistency,
        staleness=config.staleness,
        slow_worker=config.slow_worker,
        batch_size=config.batch_size,
        world_size=world_size,
    )


CAPABILITIES: dict[str, Capabilities] = {
    "single": Capabilities(one_process=True, resume_any_world=True),
    "torch-ddp": Capabilities(
        options=options_of_named(BUILTIN_STRATEGIES["torch-ddp"][1]),
        elastic=True,
        resume_any_world=True,
    ),
    "ddp": Capabilities(
        options=options_of_named(BUILTIN_STRATEGIES["ddp"][1]),
        elastic=True,
        resume_any_world=True,
    ),
    "local-sgd": Capabilities(
        options=options_of_named(BUILTIN_STRATEGIES["local-sgd"][1]),
        world_bound="it keeps one model replica per rank between averages",
    ),
    "zero1": Capabilities(options=_ZERO_1_2, elastic=True, resume_any_world=True),
    "zero2": Capabilities(options=_ZERO_1_2, elastic=True, resume_any_world=True),
    "zero3": Capabilities(
        options=options_of_named(BUILTIN_STRATEGIES["zero3"][1]),
        elastic=True,
        resume_any_world=True,
        builds_on_meta=True,
        not_compilable="its module hooks gather and free each parameter's storage around every "
        "forward",
    ),
    "pipeline": Capabilities(
        options=options_of_named(BUILTIN_STRATEGIES["pipeline"][1]),
        layout=pipeline_layout,
        world_bound=_SPLIT_BY_STAGE,
        not_compilable=_SPLITS_STAGES,
        **_OWN_SPLIT,
    ),
    "tensor": Capabilities(
        options=options_of_named(BUILTIN_STRATEGIES["tensor"][1]),
        layout=tensor_layout,
        world_bound="its parameters and optimizer state are split by tensor-parallel rank",
        not_compilable="its sharded layers issue collectives inside forward and backward",
        **_OWN_SPLIT,
    ),
    "hybrid": Capabilities(
        options=options_of_named(BUILTIN_STRATEGIES["hybrid"][1]),
        layout=hybrid_layout,
        world_bound="its parameters and optimizer state are split by stage and tensor-parallel "
        "rank",
        not_compilable=_SPLITS_STAGES,
        **_OWN_SPLIT,
    ),
    "ps": Capabilities(
        options=options_of_named(_OWN_POLICIES["ps"]),
        grad_accum=False,
        check_world=_ps_world,
        not_compilable="its workers run their own loop against the parameter servers",
    ),
}
"""What each of tessera's strategies can do (`Capabilities`), declared here beside its name so
that reading it imports no engine; a user's strategy declares its own (`register_strategy`)."""

NOT_COMPILABLE: dict[str, str] = {
    name: caps.not_compilable for name, caps in CAPABILITIES.items() if caps.not_compilable
}
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
    if name in _OWN_POLICIES:
        return _load(_OWN_POLICIES[name])
    raise _unknown(name)


def builtin_policies() -> list[type]:
    """The policy class of each of tessera's strategies, once each: the homes of the trainer's
    knobs (`tessera.strategies.knobs`)."""
    names = [*BUILTIN_STRATEGIES, *OWN_ENTRY_POINTS]
    return list(dict.fromkeys(policy_class(name) for name in names))


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
        policy = _load(_NO_OPTIONS)

    def add(factory: Callable[..., Any]) -> Callable[..., Any]:
        if name in BUILTIN_STRATEGIES or name in OWN_ENTRY_POINTS or name in _user_strategies:
            raise ValueError(f"strategy {name!r} is registered twice")
        declared = capabilities or _declared(policy) or _declared(factory) or Capabilities()
        _user_strategies[name] = (factory, policy, declared)
        return factory

    return add


def _declared(owner: Any) -> Capabilities | None:
    found = getattr(owner, "capabilities", None)
    return found if isinstance(found, Capabilities) else None


def capabilities(name: str) -> Capabilities:
    """What strategy `name` (tessera's, a parameter-server-like entry point, or a user's) can do."""
    if name in _user_strategies:
        return _user_strategies[name][2]
    if name in CAPABILITIES:
        return CAPABILITIES[name]
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
