"""Memory tools: activation checkpointing (with host offload) and a per-category memory report."""

from tessera.memory.checkpointing import checkpoint_activations, checkpointed_blocks
from tessera.memory.report import MemoryReport, report, saved_activation_bytes

__all__ = [
    "MemoryReport",
    "checkpoint_activations",
    "checkpointed_blocks",
    "report",
    "saved_activation_bytes",
]
