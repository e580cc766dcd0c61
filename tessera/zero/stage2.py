"""ZeRO stage 2 (P_os+g): optimizer states and gradients partitioned.

Rajbhandari et al., SC 2020, section 5.2. As stage 1, but the full gradients do not outlive their
reduction: a bucket's flat gradient buffer is allocated when its first gradient arrives during
backward, reduce-scattered as soon as it is complete (overlapping the rest of backward), its
average slice added to this rank's gradient shard, and the buffer freed at once
(`Reducer(release_buffers=True)`). Only 1/N of the gradients is held between steps, and at most
the buckets in flight during backward.

Communication per step: reduce-scatter + all-gather = 2Ψ elements, as DDP and stage 1. Memory
per rank: 2Ψ + (2 + K)Ψ/N bytes (mixed precision) — `memory.estimate_memory(..., stage=2)`.
"""

from __future__ import annotations

from tessera.data_parallel.bucket import Bucket
from tessera.zero.optimizer import ZeroOptimizer

__all__ = ["ZeroStage2"]


class ZeroStage2(ZeroOptimizer):
    """Optimizer states and gradients partitioned; parameters replicated."""

    stage = 2
    release_gradients = True

    def _reduce_bucket(self, bucket: Bucket) -> None:
        # Each backward's reduction adds its average into the shard: several backwards before
        # one step (accumulation, retain_graph) sum their group means, as DDP's `.grad` does.
        flat = self.flats[bucket.index]
        assert flat.bucket is bucket and flat.grad_shard is not None
        flat.grad_shard.add_(self._reduce_scatter_mean(bucket.buffer, flat.lo, flat.hi))
