"""The server's side of plain federated averaging: check reports, weighted mean, one global step.

A client's *report* is the vector `[weight * update, weight]` (float64): the weighted update with
its weight appended. Summing reports gives both the numerator and the denominator of the weighted
mean in one vector, which is what lets secure aggregation (which only reveals the sum) weight by
sample counts without the server learning any client's count. Weights are sample counts
(McMahan et al. 2017: `w <- sum_k n_k/n w_k`); with differential privacy every client weighs 1.

Server steps, on the mean `m` of the reports:
- fedavg / fedprox: the clients sent `w_k - w`, so `w <- w + m` (the weighted average of models);
- fedsgd: the clients sent gradients, so `w <- w - lr * m` (one step on the weighted-mean gradient,
  which is the full-batch gradient of the union of the clients' data when weights are counts).

Reports are summed one after another in float64, in client order: no reduction is reordered.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

import torch

__all__ = [
    "ALGORITHMS",
    "make_report",
    "mean_of_reports",
    "server_step",
    "sum_of_reports",
    "sum_to_mean",
    "update_problem",
]

ALGORITHMS = ("fedavg", "fedprox", "fedsgd")
"""Algorithm names accepted by `simulate` and `server_step`."""

log = logging.getLogger(__name__)


def update_problem(update: object, numel: int) -> str | None:
    """Why a client's update cannot be used (wrong type, shape or non-finite), or None if fine."""
    if not isinstance(update, torch.Tensor) or not update.is_floating_point():
        return f"expected a floating-point tensor, got {type(update).__name__}"
    if update.shape != (numel,):
        return f"expected shape ({numel},), got {tuple(update.shape)}"
    if not bool(torch.isfinite(update).all()):
        return f"{int((~torch.isfinite(update)).sum())} non-finite values"
    return None


def make_report(update: torch.Tensor, weight: float) -> torch.Tensor:
    """`[weight * update, weight]` in float64: what a client contributes to the sum."""
    weighted = update.detach().to(torch.float64) * float(weight)
    return torch.cat([weighted, weighted.new_tensor([float(weight)])])


def sum_of_reports(reports: Iterable[tuple[int, torch.Tensor]], numel: int) -> torch.Tensor:
    """Sum of the usable `(client, report)` pairs; bad reports are logged and skipped."""
    total = torch.zeros(numel + 1, dtype=torch.float64)
    for client, report in reports:
        problem = update_problem(report, numel + 1)
        if problem is None and not report[-1] >= 0:
            problem = f"negative weight {float(report[-1])}"
        if problem is not None:
            log.warning("federated: rejected the update of client %s: %s", client, problem)
            continue
        total += report
    return total


def mean_of_reports(reports: Iterable[tuple[int, torch.Tensor]], numel: int) -> torch.Tensor | None:
    """Weighted mean update of `(client, report)` pairs; bad reports are logged and skipped.

    Returns None when no usable report (or only zero weight) arrived: the round changes nothing.
    """
    return sum_to_mean(sum_of_reports(reports, numel))


def sum_to_mean(total: torch.Tensor) -> torch.Tensor | None:
    """`sum(weight * update) / sum(weight)` from a summed report (None if the weights sum to 0)."""
    weight = float(total[-1])
    if not weight > 0 or not math.isfinite(weight):
        return None
    return total[:-1] / weight


def server_step(
    global_vector: torch.Tensor, mean_update: torch.Tensor | None, *, algorithm: str, lr: float
) -> torch.Tensor:
    """The next global parameter vector (same dtype as `global_vector`)."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"federated: unknown algorithm {algorithm!r}; choose one of {ALGORITHMS}")
    if mean_update is None:
        return global_vector.clone()
    step = -lr * mean_update if algorithm == "fedsgd" else mean_update
    return (global_vector.to(torch.float64) + step).to(global_vector.dtype)
