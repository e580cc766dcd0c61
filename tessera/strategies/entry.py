"""`tessera.setup`: one call from a plain model and an optimizer factory to a training Engine.

Everything that can be refused without a process group is refused first: the strategy's name,
each option (against the strategy's policy dataclass, by name, listing the valid ones) and its
value (the policy's own checks), so a typo costs one message, before any rank builds anything.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from tessera.optim.loss_scale import DynamicLossScaler
from tessera.runtime.context import Context
from tessera.strategies.batch import LossFn, check_grad_accum
from tessera.strategies.engine import Engine, OptimizerFactory
from tessera.strategies.knobs import option_names
from tessera.strategies.precision import check_precision, route_to_policy
from tessera.strategies.registry import (
    BUILTIN_STRATEGIES,
    STRATEGIES,
    policy_class,
    strategy_names,
)

__all__ = ["make_policy", "setup"]


def make_policy(strategy: str, options: dict[str, Any]) -> Any:
    """The policy of `strategy` built from `options`; unknown options are refused by name."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {strategy_names()}")
    cls = policy_class(strategy)
    valid = option_names(cls)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise TypeError(
            f"strategy {strategy!r} has no option {', '.join(map(repr, unknown))}; "
            f"its options are: {', '.join(valid) if valid else 'none'}"
        )
    return cls(**options)


def setup(
    model: nn.Module,
    optimizer: OptimizerFactory,
    *,
    strategy: str = "ddp",
    loss_fn: LossFn | None = None,
    grad_clip: float = 0.0,
    grad_accum: int = 1,
    precision: str = "fp32",
    loss_scaler: DynamicLossScaler | None = None,
    ctx: Context | None = None,
    input_keys: Sequence[str] | None = None,
    target_keys: Sequence[str] | None = None,
    **options: Any,
) -> Engine:
    """Wrap `model` for training under `strategy`; return its `Engine`.

    `optimizer` is a factory `params -> torch.optim.Optimizer`, called on the model's own
    parameters (its groups by shape or identity are kept: ZeRO steps its shards with each
    group's hyper-parameters, `tessera.zero.groups`). `loss_fn` follows the batch rule of
    `tessera.strategies.batch`: `loss_fn(output, targets)` for `(inputs, targets)` batches,
    `loss_fn(output, batch)` for dict batches (default: the model's own `.loss`); a loss averaged
    over tokens is weighted by its tokens across micro-batches and ranks (labels != -100,
    `ignore_index`, or `loss_fn.count_items(targets)`: `batch.item_counter`). `grad_clip` > 0
    clips the global gradient norm in `engine.step()`. `grad_accum` K > 1 accumulates: each
    `train_step(batch)` cuts this rank's batch into K micro-batches and reduces the gradients
    over ranks once, after the last (`Engine.train_step`); a strategy whose policy has
    `microbatches` (`pipeline`, `hybrid`) accumulates over its micro-batches already and runs K
    times as many instead. It applies to every strategy, so it is `setup`'s argument, not a
    policy option. `options` are the fields of the strategy's policy (e.g. `bucket_cap_mb=` for
    ddp, `offload="cpu"` for zero1-3). `ctx` defaults to `tessera.init()`. Every rank calls
    `setup` with the same model (same initial weights).

    Why so many parameters: it is the one entry point, and each keyword is a step every strategy
    takes (loss, clip, accumulation, precision, batch keys); a strategy's own knobs go in
    `options`, its policy.

    `precision`: "fp32", "bf16" or "fp16" (autocast compute, fp32 master weights and optimizer
    state, gradients reduced in the low dtype where the strategy communicates them; fp16 with
    dynamic loss scaling by `loss_scaler`, default `DynamicLossScaler()`): see
    `tessera.strategies.precision`.

    `input_keys` and `target_keys` (together) take dict batches the user's way: each batch
    becomes `({k: batch[k] for k in input_keys}, targets)` before the batch rule, so the model
    gets only the inputs (`model(**inputs)`) and `loss_fn(output, targets)` the named target
    (or a dict of several): `tessera train --input-keys/--target-keys` does the same.

    A model built on the meta device (`with torch.device("meta"): ...`) is taken by `zero3`
    (with or without offload; `init_fn=` as in `tessera.zero.materialize`): each rank
    materialises only its shard. tessera's other strategies refuse it.
    """
    check_precision(precision, loss_scaler)
    batch_keys = _batch_keys(input_keys, target_keys)
    policy = make_policy(strategy, options)
    policy, precision = route_to_policy(policy, precision)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(optimizer, torch.optim.Optimizer) or not callable(optimizer):
        raise TypeError(
            "optimizer must be a factory params -> torch.optim.Optimizer (e.g. "
            "lambda params: torch.optim.AdamW(params, lr=1e-3)), not an optimizer: the strategy "
            "chooses the parameters it steps"
        )
    if strategy in BUILTIN_STRATEGIES and strategy != "zero3" and _any_meta(model):
        from tessera.zero.materialize import refuse_meta

        refuse_meta(model, f"strategy {strategy!r}")
    if isinstance(grad_clip, bool) or not grad_clip >= 0:
        raise ValueError(f"grad_clip must be >= 0 (0 turns clipping off), got {grad_clip!r}")
    check_grad_accum(grad_accum)
    if grad_accum > 1 and "microbatches" in option_names(type(policy)):  # the pipeline's, K-fold
        policy = dataclasses.replace(policy, microbatches=policy.microbatches * grad_accum)
    if ctx is None:
        from tessera.runtime.context import init

        ctx = init()
    build = STRATEGIES[strategy]
    steps = dict(
        loss_fn=loss_fn, grad_clip=grad_clip, grad_accum=grad_accum, precision=precision,
        loss_scaler=loss_scaler, batch_keys=batch_keys, strategy_name=strategy,
    )  # fmt: skip
    if _takes_steps(build, steps):  # built whole, in one step: the Engine does them
        return build(model, optimizer, ctx, policy=policy, **steps)
    engine = build(model, optimizer, ctx, loss_fn=loss_fn, grad_clip=grad_clip, policy=policy)
    return _finished(engine, steps, own_low_precision=_owns_low_precision(policy))


def _takes_steps(build: Any, steps: dict[str, Any]) -> bool:
    """Whether `build` takes the cross-cutting keywords `steps` (an `Engine` class, or a function
    with `**kwargs` or every one of them), not only the `loss_fn`, `grad_clip` and `policy` a
    registered builder function took before engines were built in one step."""
    if isinstance(build, type):
        return True
    parameters = inspect.signature(build).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return True
    return set(steps) <= {p.name for p in parameters}


def _owns_low_precision(policy: Any) -> bool:
    """Whether the strategy keeps its weights in the low dtype itself (ZeRO's bf16): no
    autocast on top."""
    return getattr(policy, "mixed_precision", None) is not None


def _finished(engine: Any, steps: dict[str, Any], *, own_low_precision: bool) -> Any:
    """An engine from a builder function of the old signature, given the steps it did not take
    (as `setup` once did after every build), so registered strategies keep working."""
    engine.grad_accum = steps["grad_accum"]
    engine.strategy_name = steps["strategy_name"]
    engine.batch_keys = steps["batch_keys"]
    if steps["precision"] != "fp32":
        engine.use_precision(
            steps["precision"], steps["loss_scaler"], autocast=not own_low_precision
        )
    return engine


def _batch_keys(
    input_keys: Sequence[str] | None, target_keys: Sequence[str] | None
) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """`setup`'s keys checked up front: both or neither, each a non-empty list of names."""
    if input_keys is None and target_keys is None:
        return None
    keys = []
    for name, given in (("input_keys", input_keys), ("target_keys", target_keys)):
        if isinstance(given, str) or not given or not all(isinstance(k, str) for k in given):
            raise ValueError(
                f"{name} must be a non-empty list of dict keys (input_keys and target_keys go "
                f"together), got {given!r}"
            )
        keys.append(tuple(given))
    return keys[0], keys[1]


def _any_meta(model: nn.Module) -> bool:
    """`tessera.zero.materialize.has_meta`, without importing ZeRO for every strategy."""
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])
