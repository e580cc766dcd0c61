"""Memory tools: activation checkpointing (with host offload), GeePS-style swapping of idle
parameters, and a per-category memory report."""

from tessera.memory.checkpointing import checkpoint_activations, checkpointed_blocks
from tessera.memory.report import MemoryReport, report, saved_activation_bytes
from tessera.memory.swap import IdleSwapper, swap_idle

__all__ = [
    "IdleSwapper",
    "MemoryReport",
    "checkpoint_activations",
    "checkpointed_blocks",
    "report",
    "saved_activation_bytes",
    "swap_idle",
]
