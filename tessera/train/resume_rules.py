"""What a resumed run may change: config keys that change no step, and world sizes a strategy's
checkpoint can be loaded on. Checked in the launching process, before any worker starts."""

from __future__ import annotations

from typing import Any

from tessera.errors import ConfigError
from tessera.strategies.registry import CAPABILITIES, capabilities, strategy_names
from tessera.train.config import TrainConfig
from tessera.train.config_build import config_to_dict

__all__ = [
    "RESUME_MAY_CHANGE",
    "WORLD_SIZE_FREE_STRATEGIES",
    "check_resume_config",
    "check_resume_world",
    "config_differences",
]

RESUME_MAY_CHANGE = frozenset(
    {
        "eval_data",  # held-out data: changes no step
        "steps",  # continue further (a --model without --decay-steps: stretches its decay)
        "nproc",  # another world size: see check_resume_world
        "out",  # the same folder, spelled another way
        "progress",
        "log_every",
        "checkpoint_every",
        "keep_checkpoints",
        "sample_tokens",
        "timeout_s",
        "eval_every",  # evaluation and logging change no step
        "eval_batches",
        "log_with",
        "loader.num_workers",  # who fetches a batch changes no batch (tessera.data.loader)
        "meta_init",  # the same weights either way (tessera.train.build_model); a resume loads them
    }
)
"""Config keys a resumed run may set differently: none changes what a step computes."""

WORLD_SIZE_FREE_STRATEGIES = frozenset(
    name for name, caps in CAPABILITIES.items() if caps.resume_any_world
)
"""tessera's strategies whose checkpoint loads on any world size (`Capabilities.resume_any_world`:
full replicas (DDP) or shards that are resharded on load (ZeRO)). The global batch is kept: each
rank takes batch_size / world rows. A user's strategy declares it on its own."""


WHOLE_KEYS = frozenset({"options"})
"""Config keys compared as one value: a registered strategy's `options` (an option added on
resume differs from its absence)."""


def _flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict) and f"{prefix}{key}" not in WHOLE_KEYS:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def config_differences(saved: dict[str, Any], config: TrainConfig) -> list[str]:
    """`key (saved -> now)` for every key outside RESUME_MAY_CHANGE that differs (keys the
    saved config lacks are not compared)."""
    old, new = _flatten(saved), _flatten(config_to_dict(config))
    return [
        f"{key} ({old[key]!r} -> {new[key]!r})"
        for key in sorted(old.keys() & new.keys())
        if key not in RESUME_MAY_CHANGE and old[key] != new[key]
    ]


def check_resume_config(saved: dict[str, Any], config: TrainConfig, where: str) -> None:
    """Refuse to resume a run saved with another config, naming every differing key.

    `saved` is the config the run was saved with (config.yaml, or the checkpoint's copy);
    keys in RESUME_MAY_CHANGE may differ, and keys a saved config lacks (it predates them) are
    not compared.
    """
    differing = config_differences(saved, config)
    if differing:
        raise ConfigError(
            f"cannot resume {where}: it was saved with another config; differing keys: "
            f"{', '.join(differing)}. Only {sorted(RESUME_MAY_CHANGE)} may change on resume: "
            "start a new run (another --out) to change the others"
        )


def check_resume_world(strategy: str, saved_world: int, world: int) -> None:
    """Refuse to resume a checkpoint of `saved_world` ranks on `world` ranks if the strategy
    cannot (its `Capabilities.resume_any_world`; the world-size checks of the config still
    apply)."""
    declared = capabilities(strategy)
    if saved_world == world or declared.resume_any_world:
        return
    free = sorted(name for name in strategy_names() if capabilities(name).resume_any_world)
    raise ConfigError(
        f"cannot resume a {strategy} checkpoint saved on {saved_world} ranks on {world} ranks: "
        f"{declared.world_bound}; resume it on {saved_world} ranks (strategies that change world "
        f"size on resume: {free})"
    )
