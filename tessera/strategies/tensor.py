"""Adapter for `strategy="tensor"`: Megatron-style tensor parallelism of any model over all ranks.

`TensorEngine(model, optimizer_factory, ctx, *, policy, **steps)` starts every rank from rank
0's weights (broadcast, as DDP does), splits the model over the world group by the policy's plan
(`tessera.tensor_parallel.parallelize_model`: the given plan, or the model's built-in one), and
builds the optimizer over this rank's parameters: its shards of the split layers and its copy of
the replicated ones.

Data: every tensor-parallel rank must compute on the same inputs. The caller hands each rank its
shard of the global batch (as for data parallelism); `train_step` all-gathers the shards (tensors
on dim 0 in rank order, dicts key by key, pairs element by element), so each rank runs forward
and backward on the global batch and the returned loss is the global batch's mean loss.

Randomness: dropout in a replicated region draws its mask from each rank's generator, so the
ranks' copies stay equal only if every rank seeds torch alike (the equivalence tests use dropout
0; Megatron-LM forks a separate tensor-parallel RNG for the split regions).

Gradient norm: a split parameter's shards are disjoint, so each rank adds its shard's squared
sum; a replicated parameter has the same gradient on every rank (f all-reduces the gradient
entering each split region), so only rank 0 adds it. The sum over ranks is the dense model's
squared norm, and clipping scales every rank's gradients by the same coefficient.

`TensorEngine` is an `Engine` (the batch rule, `step`, save/load/export come from the base); it
changes how the model is built, the gradient norm, the state (dense model, every rank's optimizer
state) and gathers the batch first.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tessera.optim.clip import squared_sum
from tessera.runtime.context import Context
from tessera.strategies.batch import gather_batch
from tessera.strategies.capabilities import Capabilities, tensor_layout
from tessera.strategies.engine import Engine, OptimizerFactory
from tessera.strategies.registry import declare_strategy
from tessera.strategies.step_loss import StepLoss
from tessera.tensor_parallel import (
    TensorPolicy,
    full_state_dict,
    load_full_state_dict,
    parallelize_model,
)
from tessera.tensor_parallel.layers import _Parallel

__all__ = ["TensorEngine", "TensorPolicy", "build", "build_tensor"]


class TensorEngine(Engine):
    """Tensor-parallel training of one model over the world group (the Engine protocol)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer_factory: OptimizerFactory,
        ctx: Context,
        *,
        policy: TensorPolicy | None = None,
        **steps: Any,
    ) -> None:
        """`steps`: `Engine`'s cross-cutting keywords (loss_fn, grad_clip, precision, ...)."""
        policy = policy if policy is not None else TensorPolicy()
        model.to(ctx.device)
        if ctx.world_size > 1:  # a plan slices each rank's copy: the copies must be equal
            for tensor in model.state_dict().values():
                dist.broadcast(tensor, src=0)
        # split in place: the split layers hold this rank's shards, and the optimizer the base
        # builds goes over this rank's shards and replicated parameters
        split_model = parallelize_model(model, policy.plan, group=None)
        super().__init__(split_model, optimizer_factory, ctx, policy=policy, **steps)
        self.params = list(self.module.parameters())
        split = [m for m in self.module.modules() if isinstance(m, _Parallel)]
        split_ids = {id(getattr(m, name)) for m in split for name in m.shard_dims}
        self._norm_weight = [float(id(p) in split_ids or ctx.rank == 0) for p in self.params]
        # comm_seconds: the last train_step's batch gathering (the layers' all-reduces run
        # inside forward and backward and are not separated from compute)

    loss_is_global = True  # every rank computes the gathered global batch's loss

    def train_step(self, batch: Any) -> StepLoss:
        """Forward and backward of the global batch (gathered from every rank's shard); return
        its mean loss, the same on every rank (a `StepLoss`, read when used)."""
        start = time.perf_counter()
        batch = gather_batch(batch)
        self.comm_seconds = time.perf_counter() - start
        return super().train_step(batch)

    def _eval_loss(self, batch: Any) -> float:
        """The global batch's mean loss (gathered as in `train_step`), on every rank."""
        return super()._eval_loss(gather_batch(batch))

    def squared_norm_share(self) -> torch.Tensor:
        """This rank's shards, and the replicated parameters on rank 0 only (summed over the
        world group by `Engine.reduce_squared_norm`): the dense model's squared norm."""
        return squared_sum(self.local_gradients(), self._norm_weight)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The dense model's `state_dict` with its plain keys, on every rank. Collective."""
        return full_state_dict(self.module)

    def state_dict(self) -> dict[str, Any]:
        """The dense model and every rank's optimizer state (a list by rank). Collective."""
        optimizers: list[Any] = [None] * self.ctx.world_size
        if self.ctx.world_size > 1:
            dist.all_gather_object(optimizers, self.optimizer.state_dict())
        else:
            optimizers = [self.optimizer.state_dict()]
        return self.precision_state({"model": self.full_state_dict(), "optimizer": optimizers})

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Slice the dense model into this rank's shards; take this rank's optimizer state."""
        if len(state["optimizer"]) != self.ctx.world_size:
            raise ValueError(
                f"checkpoint holds {len(state['optimizer'])} ranks' optimizers, "
                f"this run has {self.ctx.world_size} ranks"
            )
        load_full_state_dict(self.module, state["model"])
        self.optimizer.load_state_dict(state["optimizer"][self.ctx.rank])
        self.load_precision_state(state)

    def model_state_bytes(self) -> int:
        """Bytes of this rank's parameters, gradients and optimizer state."""
        tensors = [p for p in self.params] + [p.grad for p in self.params if p.grad is not None]
        for per_param in self.optimizer.state.values():
            tensors += [v for v in per_param.values() if isinstance(v, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)


build = build_tensor = TensorEngine
"""The `tensor` strategy's builder (the registry's name for the engine class)."""

declare_strategy(
    "tensor",
    TensorEngine,
    policy=TensorPolicy,
    capabilities=Capabilities(
        layout=tensor_layout,
        world_bound="its parameters and optimizer state are split by tensor-parallel rank",
        not_compilable="its sharded layers issue collectives inside forward and backward",
        activation_checkpointing=False,  # (it splits the GPT its own way)
        frees_gradients=True,
    ),
)
