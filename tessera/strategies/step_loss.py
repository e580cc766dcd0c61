"""`StepLoss`: the loss `Engine.train_step` returns, read from the device only when asked.

It is a `tessera.runtime.scalar.DeviceScalar`: `train_step` returns without waiting for the
device (no `.item()` per step), and `float(loss)`, printing or arithmetic read it then. The
trainer reads it at logged steps only.

The value is the global batch's mean loss under every strategy, on every rank: data-parallel
ranks (ddp, torch-ddp, local-sgd, zero1-3) average their batches' means with an asynchronous
all-reduce started at the end of the step and waited for when the loss is read (equal shards
under the batch rule, so the mean of the means is the mean over every row); tensor parallelism
computes it on the gathered global batch, and pipeline/hybrid on the last stage, averaged over
the dp replicas.
"""

from __future__ import annotations

from tessera.runtime.scalar import DeviceScalar

__all__ = ["StepLoss"]


class StepLoss(DeviceScalar):
    """A training step's loss: the global batch's mean, read from its device when used."""

    __slots__ = ()
