"""Federated learning: clients train on data that never leaves them; the server sums updates.

`simulate` runs FedAvg (McMahan et al. 2017), FedProx (Li et al. 2020) or FedSGD over many
clients in one process, with optional secure aggregation (Bonawitz et al. 2017, or SecAgg+ over
k neighbours, Bell et al. 2020) and client-level differential privacy (McMahan et al. 2018).
`serve` / `connect` (and `tessera fl server|client|token`) run the same code deployed, over gRPC,
each client with its own token (`client_token`).
Modules, one concept each: `partitioning` (who holds which samples), `client` (local training),
`aggregate` (the server's weighted mean and step), `secure_aggregation` (its parties in
`_secagg_protocol`, with `_shamir`, `_graph`, `_prg`, `_keys` and the fixed-point `_ring`),
`privacy`, `round` (one round, written once: selection, checks, sum, privacy, step),
`simulation` (`SimulationConfig`, and its in-process transport), `wire` (messages),
`deployed` (the gRPC server, its other transport, with `_secure_round`) and `deployed_client`,
`cli`.
The deployed names load on first use, so simulation does not need grpcio.
"""

from __future__ import annotations

import importlib
from typing import Any

from tessera.federated.aggregate import ALGORITHMS
from tessera.federated.partitioning import SCHEMES, partition
from tessera.federated.privacy import DPConfig, RDPAccountant
from tessera.federated.secure_aggregation import SecAggConfig, SecureAggregationError, secure_sum
from tessera.federated.simulation import History, SimulationConfig, simulate

__all__ = [
    "ALGORITHMS",
    "DPConfig",
    "History",
    "RDPAccountant",
    "SCHEMES",
    "SecAggConfig",
    "SecureAggregationError",
    "ServerConfig",
    "SimulationConfig",
    "client_token",
    "connect",
    "partition",
    "secure_sum",
    "serve",
    "simulate",
]

_DEPLOYED = ("ServerConfig", "client_token", "connect", "serve")


def __getattr__(name: str) -> Any:
    """Load the gRPC deployment names on first access (PEP 562)."""
    if name not in _DEPLOYED:
        raise AttributeError(f"module 'tessera.federated' has no attribute {name!r}")
    value = getattr(importlib.import_module("tessera.federated.deployed"), name)
    globals()[name] = value
    return value
