"""The strategy knobs of `TrainConfig`, generated from the policies that declare them.

Each knob (`--bucket-cap-mb`, `--schedule`, `--offload-moments`, `--servers`...) is declared once,
on its policy's field (`tessera.strategies.knobs`): its name, type, default and `--help` line.
`StrategyKnobs` is a frozen dataclass with one field per knob built from those declarations, and
`TrainConfig` inherits it, so `config.bucket_cap_mb`, the flag `--bucket-cap-mb` and the YAML key
`bucket_cap_mb` all come from `DDPPolicy.bucket_cap_mb`, and a knob added to a policy becomes a
flag with no edit here. Each generated field's metadata names its home (`"policy"`:
`(PolicyClass, field)`), whose `__post_init__` checks its value
(`tessera.train.config_strategy.check_knob_values`).
"""

from __future__ import annotations

import dataclasses
import sys

from tessera.strategies.knobs import Knob, declared_knobs
from tessera.strategies.registry import builtin_policies

__all__ = ["KNOBS", "RENAMED", "StrategyKnobs", "renamed", "warn_renamed"]

KNOBS: dict[str, Knob] = declared_knobs(builtin_policies())
"""Every strategy knob of tessera's strategies, by config name, as its policy declares it."""

StrategyKnobs = dataclasses.make_dataclass(
    "StrategyKnobs",
    [
        (
            knob.name,
            knob.annotation,
            dataclasses.field(
                default=knob.default,
                metadata={"help": knob.help, "policy": (knob.policy, knob.field)},
            ),
        )
        for knob in KNOBS.values()
    ],
    kw_only=True,
    frozen=True,
)
StrategyKnobs.__module__ = __name__  # (pickled configs name their class by it)
StrategyKnobs.__doc__ = """The strategies' knobs a `TrainConfig` holds, one field per policy field
that declares one (generated: see the module docstring)."""


def renamed(knobs: dict[str, Knob]) -> dict[str, str]:
    """Former name -> name of each renamed knob (its policy field's `old_names`); a former name
    that is a knob's name now is refused (ValueError), as it would mean two things."""
    former = {old: knob.name for knob in knobs.values() for old in knob.old_names}
    clash = sorted(set(former) & set(knobs))
    if clash:
        raise ValueError(f"knob names {clash} are also former names of other knobs")
    return former


RENAMED: dict[str, str] = renamed(KNOBS)
"""A renamed knob's former name -> its name: the old `--flag` and YAML key still work, each use
printing one deprecation line (`warn_renamed`). Empty while no knob has been renamed."""


def warn_renamed(old: str, new: str) -> None:
    """The one deprecation line of a former name (`--old-flag` or a YAML key) used."""
    print(f"tessera: {old} is deprecated: use {new}", file=sys.stderr)
