"""Pipeline parallelism: a model's layers split into stages, micro-batches streamed through.

Stage (what runs: `stage.py`) is separate from Schedule (when: `schedule.py`, pure data) and from
the runner (`runner.py`, the only code that sends). Any model is cut at named modules by
PyTorch's pipeline frontend (`trace.py`); stages exchange tuples of tensors (`messages.py`).
`wavefront` streams the time steps of a stacked RNN through its layers, one layer per rank.

Names load on first use (PEP 562): importing one module of the package (its `policy`, as
`tessera train`'s config does) does not import the rest.
"""

from __future__ import annotations

from tessera.pipeline.schedule import (  # eager: a name of the package is also a module's
    SCHEDULES,
    Action,
    bubble_fraction,
    idle_fraction,
    max_in_flight,
    schedule,
    simulate,
)
from tessera.pipeline.wavefront import (  # eager: a name of the package is also a module's
    WavefrontRNN,
    wavefront,
)
from tessera.runtime.lazy import lazy_names

__all__ = [
    "SCHEDULES",
    "Action",
    "Event",
    "HybridPolicy",
    "Pipeline",
    "PipelinePolicy",
    "WavefrontRNN",
    "balance_by_cost",
    "bubble_fraction",
    "idle_fraction",
    "max_in_flight",
    "measure_layer_times",
    "measured_idle_fraction",
    "schedule",
    "simulate",
    "wavefront",
    "write_chrome_trace",
]

_LAZY = {
    "Event": "tessera.pipeline.timeline",
    "HybridPolicy": "tessera.pipeline.policy",
    "Pipeline": "tessera.pipeline.runner",
    "PipelinePolicy": "tessera.pipeline.policy",
    "balance_by_cost": "tessera.pipeline.partition",
    "measure_layer_times": "tessera.pipeline.partition",
    "measured_idle_fraction": "tessera.pipeline.timeline",
    "write_chrome_trace": "tessera.pipeline.timeline",
}


__getattr__, __dir__ = lazy_names(__name__, _LAZY)
