"""Parameter server: sharded servers, BSP, ASP and SSP in one runtime, stragglers survived.

`run(model_fn, loss_fn, data_fn, ...)` trains with S servers and W workers and returns a `PSResult`
(final parameters, a log of every applied gradient with its clock and staleness, per-worker
updates/s and wait time). Consistency policies are pure clock rules: `BSP()`, `ASP()`,
`SSP(staleness=K)`.
"""

from tessera.parameter_server.api import DEFAULT_TIMEOUT_S, TOKEN_ENV, run
from tessera.parameter_server.errors import GradientShapeError, PeerRefused, PSTimeout, WorkerLost
from tessera.parameter_server.metrics import staleness_histogram, write_metrics
from tessera.parameter_server.policy import ASP, BSP, SSP, ConsistencyPolicy, resolve_policy
from tessera.parameter_server.result import PSResult
from tessera.parameter_server.server import ShardServer
from tessera.parameter_server.sharding import Piece, ShardPlan, plan_shards

__all__ = [
    "ASP",
    "BSP",
    "DEFAULT_TIMEOUT_S",
    "SSP",
    "TOKEN_ENV",
    "ConsistencyPolicy",
    "GradientShapeError",
    "PSResult",
    "PSTimeout",
    "PeerRefused",
    "Piece",
    "ShardPlan",
    "ShardServer",
    "WorkerLost",
    "plan_shards",
    "resolve_policy",
    "run",
    "staleness_histogram",
    "write_metrics",
]
