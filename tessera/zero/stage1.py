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

from typing import Any

import torch

from tessera.data_parallel.bucket import Bucket
from tessera.zero.optimizer import FlatShard, ZeroOptimizer

__all__ = ["ZeroStage1"]


class ZeroStage1(ZeroOptimizer):
    """Optimizer states partitioned; gradients and parameters replicated."""

    stage = 1
    release_gradients = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._reduced: set[int] = set()
        """Buckets reduced since the last step: a second reduction would be wrong."""
        super().__init__(*args, **kwargs)

    def _reduce_bucket(self, bucket: Bucket) -> None:
        flat = self.flats[bucket.index]
        assert flat.bucket is bucket
        if bucket.index in self._reduced:
            # The slice already holds the average of the last backward: summing local gradients
            # onto it would count that average N times. Stages 2 and 3 accumulate correctly.
            raise RuntimeError(
                "ZeRO-1 reduces each backward's gradients in place: call step() or zero_grad() "
                "between backward passes (to accumulate micro-batches, use stage 2 or 3)"
            )
        mine = self._reduce_scatter_mean(bucket.buffer, flat.lo, flat.hi)  # (hi - lo,)
        if mine.data_ptr() != bucket.buffer[flat.lo :].data_ptr():
            bucket.buffer[flat.lo : flat.hi].copy_(mine)
        self._reduced.add(bucket.index)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the gradients of the last backward."""
        super().zero_grad(set_to_none)
        self._reduced.clear()

    def _gradient_slice(self, flat: FlatShard) -> torch.Tensor:
        return flat.bucket.buffer[flat.lo : flat.hi]

    def _publish(self) -> None:
        self._reduced.clear()
        for flat in self.flats:
            self._collective(self._all_gather_into, flat.flat_param, flat.master.detach(), flat.lo)
