"""The options of a parameter-server job: `PSPolicy`, parsed and checked before it starts.

`tessera train --strategy ps` takes `--consistency`, `--staleness`, `--slow-worker` and the
servers/workers split as strings and integers: the fields of `PSPolicy`, each with its one
default and its `--help` line (the trainer's config fields are generated from them), checked
once, in its `__post_init__`. These functions turn them into what `parameter_server.run` takes
(a `ConsistencyPolicy`, a `{worker: factor}` map) and refuse, with one `ConfigError` naming the
option, what the job could not run. They take plain values, not the trainer's config, so the
trainer's config calls down into this package and never the reverse.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tessera.errors import ConfigError
from tessera.parameter_server.policy import SSP, ConsistencyPolicy, resolve_policy

__all__ = ["PSPolicy", "check_ps_options", "parse_slow_workers", "ps_policy"]


def ps_policy(consistency: str, staleness: int) -> ConsistencyPolicy:
    """The policy of `--consistency` (`--staleness K` applies to ssp only)."""
    if isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0:
        raise ConfigError(f"staleness must be an integer >= 0, got {staleness!r}")
    if isinstance(consistency, str) and consistency.strip().lower() == "ssp":
        return SSP(staleness=staleness)
    return resolve_policy(consistency)


def parse_slow_workers(text: str | None, num_workers: int) -> dict[int, float]:
    """`"W:F[,W:F...]"` -> `{worker: factor}`; worker numbers are 0..num_workers-1."""
    slow: dict[int, float] = {}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        worker, sep, factor = item.partition(":")
        try:
            key, value = int(worker), float(factor)
        except ValueError:
            key, value = -1, math.nan
        if not sep or not 0 <= key < num_workers or not (math.isfinite(value) and value >= 1):
            raise ConfigError(
                f"slow_worker {item!r}: expected WORKER:FACTOR with WORKER in 0..{num_workers - 1}"
                " and FACTOR >= 1, e.g. 1:3"
            )
        slow[key] = value
    return slow


@dataclass(kw_only=True, frozen=True)
class PSPolicy:
    """The parameter-server job's knobs (`tessera train --strategy ps`)."""

    servers: int = field(
        default=1,
        metadata={"help": "ps: parameter servers (the parameters are sharded over them)."},
    )
    """S: server processes; the parameters are sharded over them."""
    workers: int = field(
        default=2, metadata={"help": "ps: workers; each computes on 1/workers of the batch."}
    )
    """W: worker processes; each computes on 1/W of the global batch."""
    consistency: str = field(default="bsp", metadata={"help": "ps: bsp, asp or ssp."})
    """The clock rule: bsp, asp or ssp (`tessera.parameter_server.policy`)."""
    staleness: int = field(default=2, metadata={"help": "ps: the bound K of ssp, in clocks."})
    """SSP's bound K: a worker runs at most K clocks ahead of the slowest."""
    slow_worker: str | None = field(
        default=None,
        metadata={
            "help": "ps: WORKER:FACTOR (comma-separated for several) makes a worker FACTOR times "
            "slower. ps does not apply grad_clip."
        },
    )
    """`W:F[,W:F...]`: worker W sleeps so that it runs F times slower (a straggler to study)."""

    def __post_init__(self) -> None:
        for name in ("servers", "workers"):
            value = getattr(self, name)
            if value < 1:
                raise ConfigError(f"{name} must be at least 1 for strategy ps, got {value}")
        ps_policy(self.consistency, self.staleness)
        parse_slow_workers(self.slow_worker, self.workers)


def check_ps_options(
    *,
    servers: int,
    workers: int,
    consistency: str,
    staleness: int,
    slow_worker: str | None,
    batch_size: int,
    world_size: int | None,
) -> None:
    """Refuse a ps job that could not run, before anything starts: its options (`PSPolicy`'s
    check), and its processes against torchrun's and its workers against the batch.

    `world_size`: the number of processes torchrun started (None when tessera starts them
    itself, as servers + workers); each worker takes `batch_size / workers` of a global batch.
    """
    PSPolicy(
        servers=servers,
        workers=workers,
        consistency=consistency,
        staleness=staleness,
        slow_worker=slow_worker,
    )
    if world_size is not None and world_size != servers + workers:
        raise ConfigError(
            f"servers + workers = {servers} + {workers} must equal the "
            f"{world_size} processes tessera run / torchrun started"
        )
    if batch_size % workers:
        raise ConfigError(f"batch_size ({batch_size}) must be divisible by workers ({workers})")
