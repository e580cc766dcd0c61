"""Adapter for `strategy="tensor"`: Megatron-style tensor parallelism of any model over all ranks.

`build(model, optimizer_factory, ctx, *, loss_fn, grad_clip, policy)` starts every rank from rank
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

Until the Engine base class (`tessera/strategies/engine.py`) lands, `TensorEngine` is written
self-contained with the protocol's methods; `_compute_loss` is the batch rule of SPEC.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tessera.clip import clip_grad_norm, squared_sum, sum_over
from tessera.runtime.context import Context
from tessera.tensor_parallel import (
    TensorPolicy,
    full_state_dict,
    load_full_state_dict,
    parallelize_model,
)
from tessera.tensor_parallel.layers import _Parallel

__all__ = ["TensorEngine", "TensorPolicy", "build", "build_tensor", "gather_batch"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
LossFn = Callable[[Any, Any], torch.Tensor]

_META = 10
"""Ints describing one gathered tensor: ndim, element size, is-float, then up to 7 dims."""


def _compute_loss(module: nn.Module, batch: Any, loss_fn: LossFn | None) -> torch.Tensor:
    """SPEC.md's batch rule: a dict -> `module(**batch)` and its `.loss` / `["loss"]` (or
    `loss_fn(output, batch)`); an (inputs, targets) pair -> `loss_fn(module(inputs), targets)`."""
    if isinstance(batch, Mapping):
        out = module(**batch)
        if loss_fn is not None:
            return loss_fn(out, batch)
        loss = getattr(out, "loss", None)
        if loss is None and isinstance(out, Mapping):
            loss = out.get("loss")
        if loss is None:
            raise ValueError(
                f"{type(module).__name__} returned no loss for a dict batch (no .loss, no "
                f"['loss']): pass loss_fn=(output, batch) -> loss"
            )
        return loss
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        if loss_fn is None:
            raise ValueError("an (inputs, targets) batch needs loss_fn=(output, targets) -> loss")
        inputs, targets = batch
        return loss_fn(module(inputs), targets)
    raise TypeError(f"a batch is a dict or an (inputs, targets) pair, got {type(batch).__name__}")


def _gather_rows(tensor: torch.Tensor, world: int, device: torch.device) -> torch.Tensor:
    """Every rank's `tensor` concatenated on dim 0 in rank order (shards may differ in length).

    The shapes are exchanged first, so a rank whose shard has another trailing shape or dtype
    raises on every rank instead of leaving the collective mismatched.
    """
    tensor = tensor.to(device).contiguous()
    if tensor.dim() == 0 or tensor.dim() > _META - 3:
        raise ValueError(f"a batch tensor needs 1 to {_META - 3} dimensions, got {tensor.dim()}")
    meta = [tensor.dim(), tensor.element_size(), int(tensor.is_floating_point()), *tensor.shape]
    meta = torch.tensor(meta + [0] * (_META - len(meta)), dtype=torch.int64, device=device)
    metas = [torch.empty_like(meta) for _ in range(world)]
    dist.all_gather(metas, meta)
    rows = [int(m[3]) for m in metas]
    for rank, other in enumerate(metas):
        if not torch.equal(torch.cat([other[:3], other[4:]]), torch.cat([meta[:3], meta[4:]])):
            raise ValueError(
                f"batch shards differ beyond dim 0: rank {rank} has shape "
                f"{tuple(other[3 : 3 + int(other[0])].tolist())}, this rank {tuple(tensor.shape)}"
            )
    longest = max(rows)
    if tensor.shape[0] < longest:  # all_gather needs equal sizes: pad, then trim
        pad = tensor.new_zeros((longest - tensor.shape[0], *tensor.shape[1:]))
        tensor = torch.cat([tensor, pad])
    parts = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(parts, tensor)
    return torch.cat([part[:n] for part, n in zip(parts, rows)])


def gather_batch(batch: Any, world: int, device: torch.device) -> Any:
    """The global batch from every rank's shard: tensors on dim 0, dicts per key (in this rank's
    key order, which must be every rank's), tuples and lists element by element."""
    if isinstance(batch, torch.Tensor):
        return _gather_rows(batch, world, device) if world > 1 else batch.to(device)
    if isinstance(batch, Mapping):
        return {key: gather_batch(value, world, device) for key, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(gather_batch(value, world, device) for value in batch)
    return batch  # a non-tensor value (a flag, a string) is the same on every rank


class TensorEngine:
    """Tensor-parallel training of one model over the world group (the Engine protocol)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer_factory: OptimizerFactory,
        ctx: Context,
        *,
        loss_fn: LossFn | None = None,
        grad_clip: float = 0.0,
        policy: TensorPolicy | None = None,
    ) -> None:
        if grad_clip < 0:
            raise ValueError(f"grad_clip must be >= 0, got {grad_clip}")
        policy = policy if policy is not None else TensorPolicy()
        self.ctx, self.loss_fn, self.grad_clip = ctx, loss_fn, grad_clip
        model.to(ctx.device)
        if ctx.world_size > 1:  # a plan slices each rank's copy: the copies must be equal
            for tensor in model.state_dict().values():
                dist.broadcast(tensor, src=0)
        self.module = parallelize_model(model, policy.plan, group=None)
        """The user's model, split in place: its split layers hold this rank's shards."""
        self.params = list(self.module.parameters())
        split = [m for m in self.module.modules() if isinstance(m, _Parallel)]
        split_ids = {id(getattr(m, name)) for m in split for name in m.shard_dims}
        self._norm_weight = [float(id(p) in split_ids or ctx.rank == 0) for p in self.params]
        self.optimizer = optimizer_factory(self.params)
        """Over this rank's shards and replicated parameters; its own lr is used at each step."""
        self.comm_seconds = 0.0
        """Seconds the last `train_step` spent gathering the batch (the layers' all-reduces run
        inside forward and backward and are not separated from compute)."""

    def train_step(self, batch: Any) -> float:
        """Forward and backward of the global batch (gathered from every rank's shard); return
        its mean loss, the same on every rank."""
        start = time.perf_counter()
        batch = gather_batch(batch, self.ctx.world_size, self.ctx.device)
        self.comm_seconds = time.perf_counter() - start
        loss = _compute_loss(self.module, batch, self.loss_fn)
        loss.backward()
        return float(loss.detach())

    def clip_grad_norm(self, max_norm: float) -> float:
        """Scale every rank's gradients so the dense model's gradient norm is at most
        `max_norm`; return the norm before. Collective."""
        grads = [p.grad for p in self.params]
        total = squared_sum(grads, self._norm_weight)
        all_reduce = sum_over(None) if self.ctx.world_size > 1 else None
        return clip_grad_norm(grads, max_norm, local_sq_sum=total, all_reduce=all_reduce)

    def step(self) -> None:
        """Clip (if `grad_clip` > 0), step the optimizer with its own learning rate, zero the
        gradients."""
        if self.grad_clip > 0:
            self.clip_grad_norm(self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

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
        return {"model": self.full_state_dict(), "optimizer": optimizers}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Slice the dense model into this rank's shards; take this rank's optimizer state."""
        if len(state["optimizer"]) != self.ctx.world_size:
            raise ValueError(
                f"checkpoint holds {len(state['optimizer'])} ranks' optimizers, "
                f"this run has {self.ctx.world_size} ranks"
            )
        load_full_state_dict(self.module, state["model"])
        self.optimizer.load_state_dict(state["optimizer"][self.ctx.rank])

    def model_state_bytes(self) -> int:
        """Bytes of this rank's parameters, gradients and optimizer state."""
        tensors = [p for p in self.params] + [p.grad for p in self.params if p.grad is not None]
        for per_param in self.optimizer.state.values():
            tensors += [v for v in per_param.values() if isinstance(v, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def close(self) -> None:
        """Nothing to release: the engine holds no thread or buffer beyond the model's."""


def build(
    model: nn.Module,
    optimizer_factory: OptimizerFactory,
    ctx: Context,
    *,
    loss_fn: LossFn | None = None,
    grad_clip: float = 0.0,
    policy: TensorPolicy | None = None,
) -> TensorEngine:
    """The `tensor` strategy's Engine for `model` (split in place over every rank)."""
    return TensorEngine(
        model, optimizer_factory, ctx, loss_fn=loss_fn, grad_clip=grad_clip, policy=policy
    )


build_tensor = build
"""The name the brief of issue 20 uses for `build`."""
