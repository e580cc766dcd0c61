"""Collectives written over point-to-point messages and shared memory, with a cost model.

`all_reduce(tensor, op, algorithm=...)` runs one of `ALGORITHMS` (ring, tree, butterfly,
all_to_all, master_worker, round_robin, shm, native) or "auto", the cost model's fastest;
`all_gather` and `reduce_scatter` one of `GATHER_ALGORITHMS` (ring, shm, native) or "auto".
"""

from tessera.comm.api import (
    ALGORITHMS,
    BROADCAST_ALGORITHMS,
    GATHER_ALGORITHMS,
    all_gather,
    all_reduce,
    broadcast,
    reduce,
    reduce_scatter,
    same_host,
    shared_buffer,
)
from tessera.comm.calibrate import calibrate
from tessera.comm.cost import CostParams, choose, predict
from tessera.comm.diagnostics import history, set_checks
from tessera.runtime.flight_recorder import dump_on_failure, set_dump_dir

__all__ = [
    "ALGORITHMS",
    "BROADCAST_ALGORITHMS",
    "CostParams",
    "GATHER_ALGORITHMS",
    "all_gather",
    "all_reduce",
    "broadcast",
    "calibrate",
    "choose",
    "dump_on_failure",
    "history",
    "predict",
    "reduce",
    "reduce_scatter",
    "same_host",
    "set_checks",
    "set_dump_dir",
    "shared_buffer",
]
