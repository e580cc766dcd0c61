"""ZeRO stage 1 (P_os): each rank owns 1/N of the optimizer state.

Rajbhandari et al., SC 2020, section 5.1. Parameters and gradients stay replicated: autograd
accumulates every gradient into its bucket's flat buffer, as in DDP. When a bucket is complete
(during backward, overlapped with the rest of it) it is reduce-scattered: rank r receives the
average over ranks of its slice. The step updates only that slice (the inner optimizer and its
state exist for 1/N of the parameters), and an all-gather of the slices rebuilds every flat
parameter buffer.

Several backwards before one step (gradient accumulation, `retain_graph`) each reduce, and the
gradient is the sum of their group means, as with DDP. That holds because between reductions the
buffer keeps a value whose group mean is the sum so far: on one host the reduction is an in-place
all-reduce of the whole buffer (every rank then holds the mean, and the next backward adds its
local gradient to it, as in DDP); across hosts the reduce-scatter leaves the buffer as it was (each
rank's local sum) and the averaged slice goes to a separate gradient shard (the step reads the
one or the other: `ShardLayout.gradient_slice`). Writing the averaged slice back into a buffer
whose other slices stay local would count earlier backwards N times.

Communication per step: reduce-scatter + all-gather = 2Ψ elements, the same as DDP's all-reduce
(which is a reduce-scatter followed by an all-gather). Memory per rank: 2Ψ + 2Ψ + KΨ/N bytes
(mixed precision) — `memory.estimate_memory(..., stage=1)`; across hosts plus 2Ψ/N for the shard.
"""

from __future__ import annotations

from tessera.data_parallel.bucket import Bucket
from tessera.zero.optimizer import ZeroOptimizer

__all__ = ["ZeroStage1"]


class ZeroStage1(ZeroOptimizer):
    """Optimizer states partitioned; gradients and parameters replicated."""

    stage = 1
    release_gradients = False

    def _reduce_bucket(self, bucket: Bucket) -> None:
        flat = self.flats[bucket.index]
        assert flat.bucket is bucket
        mine = self._reduce_scatter_mean(bucket.buffer, flat.lo, flat.hi)  # (hi - lo,)
        if mine.data_ptr() == bucket.buffer[flat.lo :].data_ptr():
            return  # all-reduced in place: the whole buffer holds the group mean
        if flat.grad_shard is None:
            flat.grad_shard = self.layout.zeros(mine.numel(), mine.dtype, mine.device, stepped=True)
        flat.grad_shard.copy_(mine)  # the buffer keeps this rank's local sum (see above)
