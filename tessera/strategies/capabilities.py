"""What a strategy can do, declared once beside its name: the trainer reads the declaration.

`tessera train` needs to know, before any rank starts, things about the chosen strategy: which of
its flags the strategy takes, whether its checkpoint loads on another world size, whether it can
restart on fewer ranks, how it lays the ranks out (data x tensor x pipeline), whether it frees its
gradients after a step. Each strategy says so in one `Capabilities` value: tessera's own in its
adapter file (`tessera.strategies.registry.declare_strategy`, which derives `options` from the
strategy's policy: `tessera.strategies.knobs`), a user's strategy on its policy class or its
Engine class (`capabilities = ...`, read by `register_strategy`). Nothing in `tessera.train` or
the registry spells a strategy's name.

The defaults are what an unknown strategy may safely be assumed to do: nothing beyond training
on every rank alike (no elastic restart, no resume on another world size).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tessera.errors import ConfigError

__all__ = [
    "Capabilities",
    "FOLDED",
    "hybrid_layout",
    "pipeline_layout",
    "tensor_layout",
]

FOLDED = ""
"""`Capabilities.options` value of a trainer knob the strategy takes as part of another option
(the offload group, `--offload-params`, goes into the one `offload` policy)."""


def pipeline_layout(config: Any, world_size: int) -> tuple[int, int, int]:
    """(dp, tp, pp) of the pipeline: one stage per rank."""
    return 1, 1, world_size


def tensor_layout(config: Any, world_size: int) -> tuple[int, int, int]:
    """(dp, tp, pp) of tensor parallelism: every rank one shard of each layer."""
    return 1, world_size, 1


def hybrid_layout(config: Any, world_size: int) -> tuple[int, int, int]:
    """(dp, tp, pp) of the dp x tp x pp mix: pp 0 takes the ranks dp and tp leave; the product
    must be the world size (ConfigError otherwise)."""
    pp = config.pp or world_size // (config.dp * config.tp)
    if config.dp * config.tp * pp != world_size:
        raise ConfigError(
            f"dp x tp x pp = {config.dp} x {config.tp} x {pp} does not equal the "
            f"{world_size} ranks"
        )
    return config.dp, config.tp, pp


@dataclass(frozen=True)
class Capabilities:
    """One strategy's declaration (see the module docstring).

    Why so many fields: each is one question the trainer used to answer with a list of names.
    """

    options: Mapping[str, str] = field(default_factory=dict)
    """The `tessera train` knobs (config fields, flags) the strategy takes -> the keyword of its
    policy each becomes (`FOLDED`: taken as part of another option). A knob not listed is
    refused where it would change nothing silently (`--offload`, `--split`, `--tp-plan`).
    tessera's strategies get theirs derived from their policies' fields (`declare_strategy`)."""
    elastic: bool = False
    """Restarts on fewer ranks after a lost rank (`tessera train --min-nproc`)."""
    resume_any_world: bool = False
    """Its checkpoint loads on another world size (full replicas, or shards resharded on load);
    the global batch is kept."""
    world_bound: str = "it is not known to reshard its checkpoints"
    """Why its checkpoint cannot load on another world size (when `resume_any_world` is False)."""
    frees_gradients: bool = False
    """Its gradients are gone when a step's model states are measured (`tessera compare`)."""
    not_compilable: str | None = None
    """Why `--compile` (torch.compile of the model) is refused, or None where it works."""
    one_process: bool = False
    """It runs on exactly one rank (`--nproc auto` starts one)."""
    layout: Callable[[Any, int], tuple[int, int, int]] | None = None
    """(config, world size) -> (dp, tp, pp) for a strategy that splits the model (its config
    is then checked against the model's shape and the batch); None: data parallel only."""
    activation_checkpointing: bool = True
    """`--activation-checkpointing` (the whole model's blocks) applies."""
    builds_on_meta: bool = False
    """`--meta-init`: the model is built on the meta device and each rank materialises its shard."""
    grad_accum: bool = True
    """`--grad-accum` K > 1 applies."""
    check_world: Callable[[Any, int | None], None] | None = None
    """A strategy that starts its own processes (its own loop): (config, torchrun's world size or
    None) -> None, raising ConfigError; replaces the checks of ranks against the batch."""

    def takes(self, knob: str) -> bool:
        """Whether the strategy takes trainer knob `knob` (a config field)."""
        return knob in self.options
