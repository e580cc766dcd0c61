"""Checks of a user's workload that need its code, run once before any rank starts.

`TrainConfig` checks what the flags say (files exist, references are well formed); this imports
the factories, opens the data, and builds the model once to run one forward of one item in eval
mode without gradients, so that a wrong item shape, a model that returns no loss for a dict batch
without `--loss`, or a loss that is no scalar costs one message instead of a traceback per rank.
The demo GPT needs none of this.

Where the ranks never hold the whole model (`--strategy zero3` with `--meta-init`, not an `hf:`
model: `tessera.train.build_model`), neither does this check: the model is built on the meta
device and the item's forward runs on meta tensors, which carry shapes and dtypes but no memory.
A forward that meta tensors cannot run (`.item()`, shapes that depend on values) is checked again
on the model built whole on the CPU, as every other strategy's is (its ranks hold it whole
anyway), so the meta path never refuses a model the CPU path would accept.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tessera.errors import ConfigError
from tessera.models.user import HF_PREFIX, read_model_config, unknown_config_keys
from tessera.strategies.batch import compute_loss, no_loss_message
from tessera.strategies.registry import capabilities
from tessera.train.config import TrainConfig, job_world_size, read_tp_plan
from tessera.train.optimizers import check_optimizer_and_schedule
from tessera.train.workload import Workload, build_workload

__all__ = ["preflight_workload"]


def _builds_on_meta(config: TrainConfig) -> bool:
    """The ranks build this run's model on the meta device (`tessera.train.build_model`)."""
    factory = config.model_factory or ""
    on_meta = capabilities(config.strategy).builds_on_meta and config.meta_init
    return on_meta and not factory.startswith(HF_PREFIX)


def _build(workload: Workload, config: TrainConfig, *, meta: bool = False) -> nn.Module:
    torch.manual_seed(config.seed)
    try:
        if meta:
            with torch.device("meta"):
                return workload.model_fn()
        return workload.model_fn()
    except ConfigError:
        raise
    except Exception as exc:
        where = " on the meta device (zero3 builds it so; --no-meta-init builds it whole)"
        raise ConfigError(
            f"--model {config.model_factory}: building the model{where if meta else ''} raised "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def _check_split(model: nn.Module, config: TrainConfig) -> None:
    names = dict(model.named_modules())
    for name in (n.strip() for n in (config.split or "").split(",")):
        if name not in names:
            close = [n for n in names if n and name and n.endswith(name.split(".")[-1])][:5]
            hint = f" (modules of that name: {close})" if close else ""
            raise ConfigError(
                f"--split {name!r}: {type(model).__name__} has no module of that name{hint}"
            )


def _warn_unknown_config_keys(config: TrainConfig) -> None:
    """Warn of `--model-config` keys the `hf:` class does not know (a typo builds defaults)."""
    spec = config.model_factory or ""
    if not spec.startswith(HF_PREFIX) or config.model_config is None:
        return
    unknown = unknown_config_keys(spec, read_model_config(config.model_config))
    if unknown:
        warnings.warn(
            f"--model-config {config.model_config}: {spec[len(HF_PREFIX) :]}'s config does not "
            f"know {unknown}: they are kept as attributes but configure nothing (a typo?)",
            UserWarning,
            stacklevel=2,
        )


def _check_vocabulary(model: nn.Module, workload: Workload, config: TrainConfig) -> None:
    """A model whose input embedding has fewer rows than the data's tokenizer has tokens would
    fail with an IndexError at the first batch holding a larger id: refuse it here."""
    tokenizer = (workload.identity.get("workload") or {}).get("tokenizer") or {}
    vocab = tokenizer.get("vocab_size") or len(tokenizer.get("chars") or "")
    try:
        embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    except (NotImplementedError, AttributeError):
        embedding = None
    if vocab and isinstance(embedding, nn.Embedding) and embedding.num_embeddings < vocab:
        raise ConfigError(
            f"--model {config.model_factory} embeds {embedding.num_embeddings} token ids "
            f"(vocab_size) but the tokenizer of --data {config.data} has {vocab} tokens: set "
            f"vocab_size to at least {vocab}"
            + (" in --model-config" if config.model_config else "")
        )


def _parallel_degrees(config: TrainConfig) -> tuple[int, int]:
    """(pipeline stages, tensor-parallel size) of this run, from the config and the world."""
    layout = capabilities(config.strategy).layout
    if layout is None:
        return 1, 1
    _, tp, pp = layout(config, job_world_size(config.nproc))
    return pp, tp


def _check_model_parallel(model: nn.Module, config: TrainConfig) -> None:
    """What the pipeline and tensor engines would refuse on every rank, refused here naming the
    flags: a model they cannot cut without --split, a split without --tp-plan, a plan that
    does not fit the model (`tessera.tensor_parallel.check_plan`)."""
    from tessera.tensor_parallel import builtin_plan, check_plan

    pp, tp = _parallel_degrees(config)
    name, spec = type(model).__name__, config.model_factory
    if pp > 1 and config.split is None:
        if not isinstance(model, nn.Sequential):
            children = [n for n, _ in model.named_children()][:6]
            raise ConfigError(
                f"--strategy {config.strategy} cuts --model {spec} (a {name}) into {pp} stages: "
                f"give --split with the {pp - 1} module name(s) where stages 2..{pp} start, "
                f"comma-separated (its top-level modules: {children})"
            )
        if len(model) < pp:
            raise ConfigError(
                f"--model {spec} is an nn.Sequential of {len(model)} layers: it cannot fill "
                f"{pp} pipeline stages (use fewer ranks)"
            )
    if tp > 1:
        plan = read_tp_plan(config.tp_plan) if config.tp_plan else builtin_plan(model)
        if plan is None:
            raise ConfigError(
                f"--strategy {config.strategy} splits layers over {tp} ranks: --model {spec} "
                f"(a {name}) has no built-in plan, give --tp-plan FILE (JSON/YAML "
                "{module-name pattern: column|row|embedding})"
            )
        try:
            check_plan(model, plan, tp)
        except ValueError as exc:
            where = f"--tp-plan {config.tp_plan}" if config.tp_plan else f"{name}'s built-in plan"
            raise ConfigError(f"{where}: {exc}") from None


def _forward_failed(config: TrainConfig, batch: Any, exc: Exception) -> ConfigError:
    what = "dict item (model(**item))" if isinstance(batch, Mapping) else "(inputs, targets)"
    return ConfigError(
        f"one forward and loss of --model {config.model_factory} on one {what} of "
        f"--data {config.data} failed: {type(exc).__name__}: {exc}"
    )


def _forward_one_item(model: nn.Module, workload: Workload, config: TrainConfig) -> None:
    batch = workload.batches(0, 0, config.step_batch_size)  # one row of step 0's global batch
    if any(p.is_meta for p in model.parameters()):
        batch = _to_meta(batch)
    model.eval()
    name = type(model).__name__
    try:
        with torch.no_grad():  # the engines' own batch rule, on one item
            loss = compute_loss(model, batch, workload.loss_fn, model_name=name)
    except ValueError as exc:
        if str(exc) == no_loss_message(name):  # a dict item, no --loss, no loss of its own
            raise ConfigError(
                f"--model {config.model_factory} returned no loss for a dict item with keys "
                f"{sorted(batch)}: give --loss PKG.MODULE:FN (loss(output, batch) for dict items)"
            ) from None
        raise _forward_failed(config, batch, exc) from exc
    except Exception as exc:
        raise _forward_failed(config, batch, exc) from exc
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point()):
        shown = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ConfigError(f"the loss must be a floating-point scalar tensor, got {shown}")


def _to_meta(batch: Any) -> Any:
    """The item's tensors as meta tensors (same shapes and dtypes), for a meta-device model."""
    if isinstance(batch, Mapping):
        return {key: _to_meta(value) for key, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to_meta(value) for value in batch)
    return batch.to("meta") if isinstance(batch, torch.Tensor) else batch


def preflight_workload(config: TrainConfig) -> dict[str, Any] | None:
    """Check `config`'s user workload end to end (see the module docstring); None for the demo.

    Returns what it checked: the model's class and parameter count, the item kind, and the
    workload's `identity` (what its checkpoints record: a resume compares it up front).
    First, for every run, the optimizer and schedule are built and called once, so a bad value
    stops here and not in every rank (the strategy's options went through its policy's own checks
    when the config was built: `tessera.train.config_strategy.check_knob_values`).
    """
    check_optimizer_and_schedule(config)  # --optimizer(-args), --lr-schedule: built, called
    if config.model_factory is None:
        return None
    _warn_unknown_config_keys(config)
    workload = build_workload(config)
    meta = _builds_on_meta(config)
    model = _build(workload, config, meta=meta)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"--model {config.model_factory} built a {type(model).__name__}")
    _check_vocabulary(model, workload, config)
    if config.split is not None:
        _check_split(model, config)
    if not meta:  # (zero3 on meta: no model parallelism)
        _check_model_parallel(model, config)
    if config.activation_checkpointing:
        from tessera.memory import checkpoint_activations

        try:
            checkpoint_activations(model)
        except ValueError as exc:
            raise ConfigError(f"activation_checkpointing: {exc}") from None
    try:
        _forward_one_item(model, workload, config)
    except ConfigError:
        if not meta:
            raise
        # meta tensors cannot run every forward: check it on the whole model, as elsewhere
        model = _build(workload, config)
        _forward_one_item(model, workload, config)
    return {
        "model": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "items": workload.batch_kind,
        "identity": workload.identity,
    }
