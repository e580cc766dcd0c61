"""ZeRO stages 1-3: optimizer states, gradients and parameters sharded over data-parallel ranks.

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
(SC 2020). `initialize` wraps a plain model and optimizer class; the result is driven like plain
PyTorch and trains exactly like one process on the whole batch. Stages 1 and 2 communicate like
DDP (2Ψ elements per step), stage 3 1.5x that (3Ψ). Stage 3 also takes a model built on the
meta device and materialises only each rank's shard (`tessera.zero.materialize`).
"""

from tessera.zero.api import STAGES, full_state_dict, initialize, shard
from tessera.zero.checkpoint import consolidate, load_shards, save_shard
from tessera.zero.memory import estimate_memory, measure_memory
from tessera.zero.optimizer import ZeroOptimizer
from tessera.zero.policy import OffloadPolicy, ZeroPolicy
from tessera.zero.stage1 import ZeroStage1
from tessera.zero.stage2 import ZeroStage2
from tessera.zero.stage3 import ZeroStage3

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
