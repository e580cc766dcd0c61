"""ZeRO-1 over the data-parallel axis of a model-parallel mesh: one stage's optimizer sharded.

Each rank of a dp group holds the same pipeline stage / tensor-parallel shard. Plain data
parallelism all-reduces its gradients; here (Rajbhandari et al. 2020, ZeRO stage 1, section 5.1)
the stage's gradients, flattened into one buffer padded to a multiple of d (the dp size), are
reduce-scattered instead: dp rank r receives the average of slice r, steps only that slice with
its optimizer (whose state is thus 1/d of the stage's), and an all-gather of the slices rebuilds
the parameters. Communication per step: reduce-scatter + all-gather = 2Ψ elements, as an
all-reduce. The full gradients are freed right after the reduce-scatter, so between steps a rank
holds 1/d of them (ZeRO-2's gradient memory after backward; during the pipeline's backward the
full gradients exist, since the reduction runs once all micro-batches are done). Uses
`tessera.comm`'s reduce-scatter and all-gather (ring). This is the combination DeepSpeed refuses:
ZeRO sharding inside pipeline stages.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tessera import comm
from tessera.train.strategy import OptimizerFactory

__all__ = ["ShardedOptimizerStates"]


class ShardedOptimizerStates:
    """ZeRO-1 for `params` over `group`: reduce-scatter gradients, step a slice, all-gather."""

    def __init__(
        self,
        params: list[nn.Parameter],
        make_optimizer: OptimizerFactory,
        *,
        group: dist.ProcessGroup,
        norm_weight: list[float],
    ) -> None:
        self.params, self.group = params, group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        numel = sum(p.numel() for p in params)
        self.shard = -(-numel // self.size)  # ceil: slices of equal length
        self.numel, self.padded = numel, self.shard * self.size
        lo, hi = self.rank * self.shard, (self.rank + 1) * self.shard
        self.master = nn.Parameter(self._flatten([p.detach() for p in params])[lo:hi].clone())
        self.optimizer = make_optimizer([self.master])
        # per element: 1 if it counts in the global gradient norm (see HybridEngine.clip_grad_norm)
        weights = [torch.full((p.numel(),), w) for p, w in zip(params, norm_weight)]
        self.norm_weight = self._flatten(weights)[lo:hi]

    @torch.no_grad()
    def load_from_parameters(self) -> None:
        """Re-read this rank's slice from the parameters (after they were loaded from outside)."""
        lo = self.rank * self.shard
        self.master.copy_(self._flatten([p.detach() for p in self.params])[lo : lo + self.shard])

    def _flatten(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        flat = torch.zeros(self.padded, dtype=torch.float32)
        flat[: self.numel] = torch.cat([t.reshape(-1).float() for t in tensors])
        return flat

    def reduce_gradients(self) -> None:
        """Average the gradients over the dp group; keep this rank's slice, free the rest."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        self.master.grad = comm.reduce_scatter(self._flatten(grads), "mean", group=self.group)
        for p in self.params:
            p.grad = None

    def grad_norm_sq(self) -> torch.Tensor:
        """This slice's share of the squared global gradient norm."""
        grad = self.master.grad.double()
        return (grad.square() * self.norm_weight.double()).sum()

    def scale_gradients(self, scale: float) -> None:
        """Multiply this slice's gradient by `scale` (gradient clipping)."""
        self.master.grad.mul_(scale)

    @torch.no_grad()
    def step(self, lr: float) -> None:
        """Step this rank's slice, then all-gather every slice into the parameters."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.master.grad = None
        flat = comm.all_gather(self.master.detach(), group=self.group)  # (padded,)
        offset = 0
        for p in self.params:
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
