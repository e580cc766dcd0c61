"""The checks of the strategy knobs a `TrainConfig` holds: where the offload group and activation
checkpointing apply, and what a model-parallel layout (dp x tp x pp) needs of the GPT and the
batch. Each reads what the chosen strategy declares (`tessera.strategies.registry.capabilities`),
never its name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any

from tessera.errors import ConfigError
from tessera.strategies.capabilities import FOLDED
from tessera.strategies.registry import capabilities, offered_by
from tessera.train.config_sources import read_tp_plan
from tessera.zero.policy import MOMENT_STORAGE, OffloadPolicy

__all__ = [
    "CONVERT",
    "OFFLOAD_MOMENTS",
    "check_knob_values",
    "check_memory_options",
    "check_model_parallel",
    "policy_options",
]

OFFLOAD_MOMENTS = tuple(MOMENT_STORAGE)
"""`--offload-moments` choices: `OffloadPolicy.moments`'."""


def _split(config: Any) -> list[str] | None:
    return [name.strip() for name in config.split.split(",")] if config.split else None


def _tp_plan(config: Any) -> dict[str, str] | None:
    return read_tp_plan(config.tp_plan) if config.tp_plan else None


def _offload(config: Any) -> OffloadPolicy | None:
    """ZeRO's `offload` option from the offload group of flags (None: no offload)."""
    if config.offload is None:
        return None
    return OffloadPolicy(device=config.offload, **_group_values(config, OffloadPolicy))


CONVERT: dict[str, Callable[[Any], Any]] = {
    "offload": _offload,
    "split": _split,
    "tp_plan": _tp_plan,
}
"""Knobs whose command-line form is not the policy's (a file name, a comma-separated list, a
group of flags): how each becomes the policy's value."""


def _homes(config: Any) -> dict[str, tuple[type, str]]:
    """Config field -> (policy class, field) of every strategy knob the config holds."""
    return {f.name: f.metadata["policy"] for f in fields(config) if "policy" in f.metadata}


def _group_values(config: Any, policy: type, *, given_only: bool = False) -> dict[str, Any]:
    """The config's values of `policy`'s knobs, under the policy's names (`given_only`: those
    set to another value than the default)."""
    values = {}
    for knob, (home, name) in _homes(config).items():
        value = getattr(config, knob)
        if home is policy and not (
            given_only and value == policy.__dataclass_fields__[name].default
        ):
            values[name] = CONVERT[knob](config) if knob in CONVERT else value
    return values


def policy_options(config: Any) -> dict[str, Any]:
    """`tessera.setup`'s options for `config.strategy`, from the trainer's config: the knobs its
    `Capabilities.options` declares, under the policy's names, and the config's `options`
    (a registered strategy's own policy fields). Mixed precision goes to setup's `precision`,
    which gives ZeRO's policy its bf16."""
    declared = capabilities(config.strategy).options
    options = {
        keyword: CONVERT[knob](config) if knob in CONVERT else getattr(config, knob)
        for knob, keyword in declared.items()
        if keyword != FOLDED
    }
    return {**options, **config.options}


def check_knob_values(config: Any) -> None:
    """Every strategy knob's value, checked by the policy it belongs to (its one check): the
    chosen strategy's policy as `tessera.setup` will build it, and each other policy whose knobs
    the config sets to other values than their defaults (a bad value is refused whatever the
    strategy, as it always was)."""
    declared = capabilities(config.strategy).options
    twice = sorted(set(config.options) & {keyword for keyword in declared.values() if keyword})
    if twice:
        flags = [knob for knob, keyword in declared.items() if keyword in twice]
        raise ConfigError(
            f"options {twice} of strategy {config.strategy} are its flags "
            f"{['--' + knob.replace('_', '-') for knob in flags]}: set them there, once"
        )
    if capabilities(config.strategy).check_world is None:  # (ps: its own processes)
        from tessera.strategies.entry import make_policy

        try:
            make_policy(config.strategy, policy_options(config))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"strategy {config.strategy}: {exc}") from exc
    for policy in dict.fromkeys(home for home, _ in _homes(config).values()):
        values = _group_values(config, policy, given_only=True)
        if policy is OffloadPolicy and config.offload is not None:
            values["device"] = config.offload
        try:
            policy(**values)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc  # (the cause: the policy's check)


def check_memory_options(config: Any) -> None:
    """Offload and activation checkpointing: where they apply, and nvme_dir up front."""
    caps = capabilities(config.strategy)
    if config.offload and not caps.takes("offload"):
        raise ConfigError(
            f"offload={config.offload} offloads ZeRO's sharded state: it needs strategy "
            f"{_either(offered_by('offload'))}, not {config.strategy}"
        )
    if config.offload and config.optimizer != "adamw":
        raise ConfigError(f"offload={config.offload} runs a CPU Adam: it needs optimizer adamw")
    if config.offload != "nvme" and config.nvme_dir is not None:
        raise ConfigError("nvme_dir needs offload nvme")
    if config.offload_params and (not caps.takes("offload_params") or config.offload is None):
        raise ConfigError(
            "offload_params moves ZeRO-3's partitions: use "
            f"{_either(offered_by('offload_params'))} with offload"
        )
    if config.offload_moments != "fp32" and config.offload != "cpu":
        raise ConfigError(
            f"offload_moments={config.offload_moments} is CPUAdam's storage: it needs offload "
            f"cpu, not offload {config.offload}"
        )
    if config.delayed_update and config.offload != "cpu":  # as tessera.zero.delayed checks
        raise ConfigError(
            "delayed_update overlaps ZeRO-Offload's host step with the next forward/backward:"
            f" it needs offload cpu, not offload {config.offload}"
        )
    if config.offload == "nvme":
        from tessera.optim.swap_files import check_swap_dir

        try:
            check_swap_dir(config.nvme_dir)
        except (ValueError, OSError) as error:
            raise ConfigError(str(error)) from None
    if config.activation_checkpointing and not caps.activation_checkpointing:
        raise ConfigError(
            f"activation_checkpointing wraps the whole GPT's blocks; strategy "
            f"{config.strategy} splits the model its own way and does not support it"
        )


def check_model_parallel(config: Any, dp: int, tp: int, pp: int) -> None:
    """What the pipeline and tensor-parallel engines need of the GPT and the batch (a user's
    model: of the batch; tessera.train.preflight checks the model)."""
    model, v = config.model, config.virtual_stages
    # (v >= 2 exactly with schedule interleaved: PipelinePolicy's check, run before this)
    if v > 1 and config.microbatches % pp:
        raise ConfigError(f"interleaved: microbatches must be a multiple of pp ({pp})")
    if v > 1 and config.model_factory is None and model.n_layer < pp * v:
        raise ConfigError(f"interleaved: {model.n_layer} GPT blocks cannot fill {pp * v} chunks")
    if config.model_factory is None and model.n_head % tp:
        raise ConfigError(
            f"model.n_head ({model.n_head}) must be divisible by the tensor-parallel degree ({tp})"
        )
    if config.model_factory is None and pp > model.n_layer + 2:  # [embedding, *blocks, head]
        raise ConfigError(
            f"{pp} pipeline stages need at least {pp - 2} blocks (each stage holds one of "
            f"embedding, blocks, head); model.n_layer is {model.n_layer}"
        )
    rows = config.batch_size // dp
    if capabilities(config.strategy).takes("microbatches") and config.microbatches > rows:
        raise ConfigError(
            f"microbatches ({config.microbatches}) must not exceed the batch each pipeline "
            f"splits: batch_size {config.batch_size} / dp {dp} = {rows} sequences"
        )


def _either(names: list[str]) -> str:
    """["a", "b", "c"] -> "a, b or c"."""
    return " or ".join(filter(None, [", ".join(names[:-1]), names[-1]])) if names else "none"
