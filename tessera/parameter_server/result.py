"""What `run` returns: the final parameters, the per-gradient log and per-worker measurements."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["PSResult", "merge_logs"]


@dataclass
class PSResult:
    """The outcome of a parameter-server run (the same object on every rank)."""

    state_dict: dict[str, torch.Tensor]
    """The final parameters, assembled from the servers' shards."""
    log: list[dict[str, Any]]
    """One record per applied gradient, in apply order: `worker`; `clock` (the updates that worker
    had completed when it read); `min_clock` (the slowest live worker's completed updates at that
    read); `staleness` (gradients applied between that read and this apply); `time` (Unix
    seconds); `loss` (the worker's loss on that mini-batch)."""
    events: list[dict[str, Any]]
    """Refused peers and gradients, dropped workers: `event`, `server`, `time` and details."""
    updates_per_s: list[float]
    """Per worker (NaN for a dropped worker)."""
    wait_s: list[float]
    """Per worker: seconds in pulls and pushes, waiting for the policy included (NaN if dropped)."""
    wall_s: float
    """Seconds from the servers' start to the end of training."""
    dropped_workers: list[int] = field(default_factory=list)
    """Workers dropped after falling silent (ASP and SSP only)."""
    phases_s: list[dict[str, float]] = field(default_factory=list)
    """Per worker: seconds in `pull_s` (held back by the policy included), `compute_s` (data,
    forward, backward), `sleep_s` (a slow worker's deliberate sleep) and `push_s` (the server
    applies before it answers); NaN for a dropped worker. What bounds a run's updates/s."""


def merge_logs(server_logs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One record per gradient from the S servers' records of it.

    Every gradient is applied on every shard, each server logging what it saw. The merged record
    keeps the worst case: the smallest `min_clock` and the largest `staleness` over the servers, so
    a bound that holds on the merged log held on every shard.
    """
    merged: dict[tuple[int, int], dict[str, Any]] = {}
    for records in server_logs:
        for record in records:
            key = (record["worker"], record["clock"])
            rec = {k: v for k, v in record.items() if k != "server"}
            if key not in merged:
                merged[key] = rec
                continue
            seen = merged[key]
            seen["min_clock"] = min(seen["min_clock"], rec["min_clock"])
            seen["staleness"] = max(seen["staleness"], rec["staleness"])
            seen["time"] = max(seen["time"], rec["time"])
    return sorted(merged.values(), key=lambda r: (r["time"], r["worker"]))
