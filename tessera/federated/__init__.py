"""Federated learning: clients train on data that never leaves them; the server sums updates.

`simulate` runs FedAvg (McMahan et al. 2017), FedProx (Li et al. 2020) or FedSGD over many
clients in one process, with optional secure aggregation (Bonawitz et al. 2017) and client-level
differential privacy (McMahan et al. 2018). Modules, one concept each: `partitioning` (who holds
which samples), `client` (local training), `aggregate` (the server's weighted mean and step),
`secure_aggregation`, `privacy`, `simulation`.
"""

from tessera.federated.aggregate import ALGORITHMS
from tessera.federated.partitioning import SCHEMES, partition
from tessera.federated.privacy import DPConfig, RDPAccountant
from tessera.federated.secure_aggregation import SecureAggregationError, secure_sum
from tessera.federated.simulation import History, simulate

__all__ = [
    "ALGORITHMS",
    "DPConfig",
    "History",
    "RDPAccountant",
    "SCHEMES",
    "SecureAggregationError",
    "partition",
    "secure_sum",
    "simulate",
]
