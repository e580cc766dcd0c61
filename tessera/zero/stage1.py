"""ZeRO stage 1 (P_os): each rank owns 1/N of the optimizer state.

Rajbhandari et al., SC 2020, section 5.1. Parameters and gradients stay replicated: autograd
accumulates every gradient into its bucket's flat buffer, as in DDP. When a bucket is complete
(during backward, overlapped with the rest of it) it is reduce-scattered: rank r receives the
average over ranks of its slice, which it writes back into its own slice of the buffer. The step
updates only that slice (the inner optimizer and its state exist for 1/N of the parameters), and
an all-gather of the slices rebuilds every flat parameter buffer.

Communication per step: reduce-scatter + all-gather = 2Ψ elements, the same as DDP's all-reduce
(which is a reduce-scatter followed by an all-gather). Memory per rank: 2Ψ + 2Ψ + KΨ/N bytes
(mixed precision) — `memory.estimate_memory(..., stage=1)`.
"""

from __future__ import annotations

import torch

from tessera import comm
from tessera.data_parallel.bucket import Bucket
from tessera.zero.optimizer import FlatShard, ZeroOptimizer, _all_gather

__all__ = ["ZeroStage1"]


class ZeroStage1(ZeroOptimizer):
    """Optimizer states partitioned; gradients and parameters replicated."""

    stage = 1
    release_gradients = False

    def _reduce_bucket(self, bucket: Bucket) -> None:
        flat = self.flats[bucket.index]
        assert flat.bucket is bucket
        mine = comm.reduce_scatter(bucket.buffer, "mean", group=self.group)  # (hi - lo,)
        bucket.buffer[flat.lo : flat.hi].copy_(mine)

    def _gradient_slice(self, flat: FlatShard) -> torch.Tensor:
        return flat.bucket.buffer[flat.lo : flat.hi]

    def _publish(self) -> None:
        for flat in self.flats:
            self._collective(_gather_into, flat, self.group)


@torch.no_grad()
def _gather_into(flat: FlatShard, group: object) -> None:
    """All-gather every rank's updated slice into the flat parameter buffer (stages 1 and 2)."""
    mine = flat.master.detach()
    if mine.dtype != flat.flat_param.dtype:  # mixed precision: fp32 master -> bf16 parameter
        mine = mine.to(flat.flat_param.dtype)
    flat.flat_param.copy_(_all_gather(mine, group))
