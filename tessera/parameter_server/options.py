"""The options of a parameter-server job as plain values: parsed and checked before it starts.

`tessera train --strategy ps` takes `--consistency`, `--staleness`, `--slow-worker` and the
servers/workers split as strings and integers; these functions turn them into what
`parameter_server.run` takes (a `ConsistencyPolicy`, a `{worker: factor}` map) and refuse, with
one `ConfigError` naming the option, what the job could not run. They take plain values, not the
trainer's config, so the trainer's config calls down into this package and never the reverse.
"""

from __future__ import annotations

import math

from tessera.errors import ConfigError
from tessera.parameter_server.policy import SSP, ConsistencyPolicy, resolve_policy

__all__ = ["check_ps_options", "parse_slow_workers", "ps_policy"]


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
    """Refuse a ps job that could not run, before anything starts.

    `world_size`: the number of processes torchrun started (None when tessera starts them
    itself, as servers + workers); each worker takes `batch_size / workers` of a global batch.
    """
    for name, value in (("servers", servers), ("workers", workers)):
        if value < 1:
            raise ConfigError(f"{name} must be at least 1 for strategy ps, got {value}")
    ps_policy(consistency, staleness)
    parse_slow_workers(slow_worker, workers)
    if world_size is not None and world_size != servers + workers:
        raise ConfigError(
            f"servers + workers = {servers} + {workers} must equal the "
            f"{world_size} processes tessera run / torchrun started"
        )
    if batch_size % workers:
        raise ConfigError(f"batch_size ({batch_size}) must be divisible by workers ({workers})")
