"""Pipeline parallelism: a model's layers split into stages, micro-batches streamed through.

Stage (what runs: `stage.py`) is separate from Schedule (when: `schedule.py`, pure data) and from
the runner (`runner.py`, the only code that sends). Any model is cut at named modules by
PyTorch's pipeline frontend (`trace.py`); stages exchange tuples of tensors (`messages.py`).
`wavefront` streams the time steps of a stacked RNN through its layers, one layer per rank.
"""

from tessera.pipeline.partition import balance_by_cost, measure_layer_times
from tessera.pipeline.policy import HybridPolicy, PipelinePolicy
from tessera.pipeline.runner import Pipeline
from tessera.pipeline.schedule import (
    SCHEDULES,
    Action,
    bubble_fraction,
    idle_fraction,
    max_in_flight,
    schedule,
    simulate,
)
from tessera.pipeline.timeline import Event, measured_idle_fraction, write_chrome_trace
from tessera.pipeline.wavefront import WavefrontRNN, wavefront

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
