"""The collectives of one ZeRO optimizer, on its group's one communication stream.

Every collective a ZeRO stage issues after construction (the gradient reductions, the
all-gathers that publish a step or gather a stage-3 unit, checkpoint barriers) goes through the
reducer's queue on the group's stream (`tessera.comm.stream`), so every rank issues them in the
same order as any other engine's on the group; each is waited for with the group's timeout and
named after the stage in the error. `ZeroOptimizer` builds one and hands it to what issues them.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

from tessera import comm
from tessera.data_parallel.reducer import Reducer
from tessera.runtime.wait import wait_or_raise

__all__ = ["ZeroCollectives"]


class ZeroCollectives:
    """Submit to, and wait on, the group's communication stream (through its `Reducer`)."""

    def __init__(
        self, reducer: Reducer, group: dist.ProcessGroup | None, stage: int, timeout_s: float
    ) -> None:
        self.reducer = reducer
        self.group = group
        self.stage = stage
        self.timeout_s = timeout_s

    def submit(self, fn: Any, *args: Any, item: int = -1) -> Future:
        """Queue `fn(*args)` on the group's stream (labelled with `item`); its future."""
        return self.reducer.submit(fn, *args, item=item)

    def wait(self, future: Future, what: str) -> Any:
        """The result of a queued collective `what`, or a clear error at the group's timeout."""
        return wait_or_raise(
            future,
            f"ZeRO-{self.stage} {what}",
            self.timeout_s,
            dist.get_rank(),
            "another rank has not reached the same step (or has failed)",
        )

    def run(self, fn: Any, *args: Any, item: int = -1) -> Any:
        """Run `fn(*args)` on the group's stream and wait for it (labelled with `item`)."""
        future = self.submit(fn, *args, item=item)
        return self.wait(future, getattr(fn, "__name__", "collective"))

    @torch.no_grad()
    def all_gather_into(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        """Fill `full` with every rank's `shard` (rank r's at `[r * len, (r + 1) * len)`), on
        the calling thread (run it on the stream with `run` or `submit`).

        `shard` may be a view of `full` (`comm.all_gather` allows that).
        """
        comm.all_gather(shard.to(full.dtype), group=self.group, out=full)
