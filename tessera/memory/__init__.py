"""Memory tools: activation checkpointing (with host offload) and a per-category memory report."""

from tessera.memory.checkpointing import checkpoint_activations, checkpointed_blocks

__all__ = ["checkpoint_activations", "checkpointed_blocks"]
