"""ZeRO stages 1-3: optimizer states, gradients and parameters sharded over data-parallel ranks.

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
(SC 2020). `initialize` wraps a plain model and optimizer class; the result is driven like plain
PyTorch and trains exactly like one process on the whole batch. Stages 1 and 2 communicate like
DDP (2Ψ elements per step), stage 3 1.5x that (3Ψ). Stage 3 also takes a model built on the
meta device and materialises only each rank's shard (`tessera.zero.materialize`).

Names load on first use (PEP 562): importing one module of the package (its `policy`, as
`tessera train`'s config does) does not import the rest.
"""

from __future__ import annotations

from tessera.runtime.lazy import lazy_names

__all__ = [
    "STAGES",
    "OffloadPolicy",
    "ZeroOptimizer",
    "ZeroStage1",
    "ZeroStage2",
    "ZeroStage3",
    "ZeroPolicy",
    "consolidate",
    "estimate_memory",
    "full_state_dict",
    "initialize",
    "load_shards",
    "measure_memory",
    "save_shard",
    "shard",
]

_LAZY = {
    "STAGES": "tessera.zero.api",
    "OffloadPolicy": "tessera.zero.policy",
    "ZeroOptimizer": "tessera.zero.optimizer",
    "ZeroStage1": "tessera.zero.stage1",
    "ZeroStage2": "tessera.zero.stage2",
    "ZeroStage3": "tessera.zero.stage3",
    "ZeroPolicy": "tessera.zero.policy",
    "consolidate": "tessera.zero.checkpoint",
    "estimate_memory": "tessera.zero.memory",
    "full_state_dict": "tessera.zero.api",
    "initialize": "tessera.zero.api",
    "load_shards": "tessera.zero.checkpoint",
    "measure_memory": "tessera.zero.memory",
    "save_shard": "tessera.zero.checkpoint",
    "shard": "tessera.zero.api",
}


__getattr__, __dir__ = lazy_names(__name__, _LAZY)
