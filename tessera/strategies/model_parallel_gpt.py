"""Interim `pipeline`, `tensor` and `hybrid` strategies: tessera's GPT on a dp x tp x pp mesh.

The registry resolves the three names here until the adapters for any model
(`tessera.strategies.pipeline`, `tessera.strategies.tensor`) exist; this module then goes.

Order of composition (as in Megatron-LM and torchtitan): tensor parallelism inside each block
(`parallelize_gpt` over the mesh's tp group), then the block sequence cut into pipeline stages
(`Pipeline` over the pp group), then data parallelism across the dp group: every stage's
gradients are averaged over its dp peers by tessera's DDP reducer, bucket by bucket during the
stage's W pass (`dp_sharding.py`; torch DDP cannot wrap a stage whose backward is driven micro-batch
by micro-batch), or sharded with ZeRO-1/2.

Data: each rank passes its 1/world shard of the global batch, an `(inputs, targets)` pair; the
engine all-gathers the shards (token ids: a few KB) and gives dp replica d rows
`[d B/dp, (d+1) B/dp)`, so the step equals one process on the global batch, and returns the
global mean loss. `pipeline` is the mesh `pp = world`, `tensor` is `tp = world`; `hybrid` takes
the degrees `dp`, `tp`, `pp` (0: what dp and tp leave), `microbatches`, `schedule` and `zero`
(0, or 1 / 2 for ZeRO-1 / ZeRO-2 over the dp axis inside each stage, `dp_sharding.py`).

Checkpoints: `state_dict()` (collective) returns the dense GPT state and every rank's optimizer
state as a list indexed by global rank; `load_state_dict` slices the dense state back into this
rank's stage and tensor-parallel shards and takes its own optimizer state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tessera.clip import clip_grad_norm, squared_sum, sum_over
from tessera.mesh import Mesh
from tessera.models import GPT
from tessera.pipeline.dp_sharding import StageDataParallel, StageZero
from tessera.pipeline.gpt import gpt_as_sequential, gpt_state_from_sequential
from tessera.pipeline.runner import Pipeline
from tessera.runtime.context import Context
from tessera.strategies.batch import LossFn, gather_batch
from tessera.strategies.engine import Engine, OptimizerFactory
from tessera.tensor_parallel import full_state_dict, parallelize_gpt
from tessera.tensor_parallel.layers import _Parallel, shard

__all__ = [
    "HybridEngine",
    "HybridPolicy",
    "PipelinePolicy",
    "TensorPolicy",
    "build_hybrid",
    "build_pipeline",
    "build_tensor",
]

SCHEDULES = ("naive", "gpipe", "1f1b")


def _check_pipeline(microbatches: int, schedule: str) -> None:
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches must be an integer >= 1, got {microbatches!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {SCHEDULES}")


@dataclass(kw_only=True, frozen=True)
class PipelinePolicy:
    """Every rank one pipeline stage of the GPT."""

    microbatches: int = 4
    """Micro-batches per step."""
    schedule: str = "1f1b"
    """naive, gpipe or 1f1b."""

    def __post_init__(self) -> None:
        _check_pipeline(self.microbatches, self.schedule)


@dataclass(kw_only=True, frozen=True)
class TensorPolicy:
    """Every block's attention heads and MLP split over all ranks (no options for the GPT)."""


@dataclass(kw_only=True, frozen=True)
class HybridPolicy:
    """dp x tp x pp over the ranks, optionally ZeRO-1/2 over dp inside each stage."""

    dp: int = 1
    """Data-parallel degree."""
    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 0
    """Pipeline stages; 0 takes the ranks dp and tp leave."""
    zero: int = 0
    """1 shards optimizer states, 2 also gradients, over each stage's dp group."""
    microbatches: int = 4
    """Micro-batches per step."""
    schedule: str = "1f1b"
    """naive, gpipe or 1f1b."""
    bucket_cap_mb: float = 25.0
    """Gradient bucket size of the dp reduction, in MB."""

    def __post_init__(self) -> None:
        for name in ("dp", "tp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.pp < 0:
            raise ValueError(f"pp must be >= 0 (0: the ranks dp and tp leave), got {self.pp}")
        if self.zero not in (0, 1, 2):
            raise ValueError(
                f"zero must be 0, 1 or 2 inside model-parallel stages, got {self.zero}"
            )
        if not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {self.bucket_cap_mb}")
        _check_pipeline(self.microbatches, self.schedule)


class HybridEngine(Engine):
    """Data x tensor x pipeline parallel training of the reference GPT."""

    def __init__(
        self,
        module: nn.Module,
        make_optimizer: OptimizerFactory,
        ctx: Context,
        *,
        loss_fn: LossFn | None = None,
        grad_clip: float = 0.0,
        dp: int = 1,
        tp: int = 1,
        pp: int = 1,
        num_microbatches: int = 4,
        schedule: str = "1f1b",
        zero: int = 0,
        bucket_cap_mb: float = 25.0,
        policy: Any = None,
    ) -> None:
        if zero not in (0, 1, 2):
            raise ValueError(f"zero must be 0, 1 or 2 inside model-parallel stages, got {zero}")
        if not isinstance(module, GPT):
            raise ValueError(f"model-parallel strategies need the GPT, not {type(module).__name__}")
        if dp * tp * pp != ctx.world_size:
            raise ValueError(f"dp {dp} x tp {tp} x pp {pp} != world size {ctx.world_size}")
        if grad_clip < 0:
            raise ValueError(f"grad_clip must be >= 0 (0 turns clipping off), got {grad_clip!r}")
        self.module, self.ctx, self.comm_seconds = module, ctx, 0.0
        self.loss_fn, self.grad_clip, self.policy = loss_fn, float(grad_clip), policy
        self.mesh = Mesh(dp=dp, tp=tp, pp=pp)
        self.tp_group, self.dp_group = self.mesh.group("tp"), self.mesh.group("dp")
        if tp > 1:
            parallelize_gpt(module, group=self.tp_group)
        layers = gpt_as_sequential(module)
        self.pipe = Pipeline(
            layers,
            num_microbatches=num_microbatches,
            schedule=schedule,
            group=self.mesh.group("pp"),
            timeout_s=ctx.timeout_s,
        )
        _release_other_stages(layers, self.pipe.module)
        self.params = list(self.pipe.module.parameters())
        split = [m for m in self.pipe.module.modules() if isinstance(m, _Parallel)]
        split_ids = {id(getattr(m, name)) for m in split for name in m.shard_dims}
        # A parameter counts in the global gradient norm once: tensor-parallel shards on every tp
        # rank, replicated ones on tp rank 0 only, tied ones on their first stage only.
        tp_rank = self.mesh.rank("tp")
        self._norm_weight = [
            float(self.pipe.counts_in_norm(p) and (id(p) in split_ids or tp_rank == 0))
            for p in self.params
        ]
        self.dp_sync: StageDataParallel | StageZero | None = None
        """Averages (or shards) the stage's gradients over the dp group during the W pass."""
        if zero and dp > 1:
            self.dp_sync = StageZero(
                self.pipe.module,
                make_optimizer,
                stage=zero,
                group=self.dp_group,
                norm_weight={id(p): w for p, w in zip(self.params, self._norm_weight)},
                bucket_cap_mb=bucket_cap_mb,
            )
            self.optimizer = self.dp_sync.optimizer
        else:
            if dp > 1:
                self.dp_sync = StageDataParallel(
                    self.pipe.module, group=self.dp_group, bucket_cap_mb=bucket_cap_mb
                )
            self.optimizer = make_optimizer(self.params)

    @property
    def zero(self) -> StageZero | None:
        """The ZeRO sharding of this rank's stage over its dp group, if any."""
        return self.dp_sync if isinstance(self.dp_sync, StageZero) else None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Forward alone is not a pipeline step: drive `train_step`."""
        raise NotImplementedError(
            "model-parallel engines run forward and backward together: call train_step"
        )

    def train_step(self, batch: Any) -> float:
        """All stages' forward and backward of the global batch (this rank's shard of it, an
        `(inputs, targets)` pair, gathered over the ranks); return its mean loss."""
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise TypeError(
                "the GPT's model-parallel engine takes (inputs, targets) pairs, got "
                f"{type(batch).__name__}"
            )
        if self.loss_fn is None:
            raise ValueError("an (inputs, targets) batch needs loss_fn=fn(output, targets)")
        loss_fn = self.loss_fn
        world, dp = self.ctx.world_size, self.mesh.size("dp")
        inputs, targets = gather_batch(tuple(batch)) if world > 1 else batch
        if inputs.shape[0] % dp:
            raise ValueError(f"global batch {inputs.shape[0]} does not split over dp={dp}")
        rows = inputs.shape[0] // dp
        d = self.mesh.rank("dp")
        x, y = inputs[d * rows : (d + 1) * rows], targets[d * rows : (d + 1) * rows]
        if self.dp_sync is None:
            return self.pipe.train_step(x, y, loss_fn)
        # the dp reduction runs during the W pass, bucket by bucket as the gradients complete
        loss = self.pipe.train_step(x, y, loss_fn, before_weight_pass=self.dp_sync.arm)
        self.comm_seconds = self.dp_sync.finish()
        loss_sum = torch.tensor([loss])
        dist.all_reduce(loss_sum, group=self.dp_group)
        return float(loss_sum) / dp

    def clip_grad_norm(self, max_norm: float) -> float:
        """Global norm over every stage and shard (replicated and tied parameters once)."""
        if self.zero is not None:  # each dp rank holds a distinct slice of the averaged grads
            total, grads = self.zero.grad_norm_sq(), self.zero.inner.gradient_slices()
        else:  # dp replicas hold equal gradients after averaging: dp rank 0 counts them
            grads = [p.grad for p in self.params]
            weights = self._norm_weight if self.mesh.rank("dp") == 0 else [0.0] * len(grads)
            total = squared_sum(grads, weights)
        all_reduce = sum_over(None) if self.ctx.world_size > 1 else None
        return clip_grad_norm(grads, max_norm, local_sq_sum=total, all_reduce=all_reduce)

    def optimizer_step(self) -> None:
        """Apply the optimizer (ZeRO: step this rank's slices and all-gather them)."""
        if self.zero is None:
            super().optimizer_step()
        else:
            self.zero.step()

    def model_state_bytes(self) -> int | None:
        """Under ZeRO: bytes of this rank's parameters, gradients and optimizer state."""
        return self.zero.model_state_bytes() if self.zero is not None else None

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The dense GPT state dict (GPT keys) on every rank; collective."""
        stage_state = full_state_dict(self.pipe.module, group=self.tp_group)
        state = self.pipe.full_state_dict(stage_state=stage_state)
        return gpt_state_from_sequential(state, self.module.config.n_layer)

    def state_dict(self) -> dict[str, Any]:
        """Dense model and every rank's optimizer state (list by global rank); collective."""
        optimizers: list[Any] = [None] * self.ctx.world_size
        if self.ctx.world_size > 1:
            dist.all_gather_object(optimizers, self.optimizer.state_dict())
        else:
            optimizers = [self.optimizer.state_dict()]
        return {"model": self.full_state_dict(), "optimizer": optimizers}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Slice the dense model into this rank's stage and shards; take this rank's optimizer."""
        if len(state["optimizer"]) != self.ctx.world_size:
            raise ValueError(
                f"checkpoint holds {len(state['optimizer'])} ranks' optimizers, "
                f"this run has {self.ctx.world_size} ranks"
            )
        n_layer = self.module.config.n_layer
        layers = dict(self.pipe.module.named_modules())
        local = {}
        for key in self.pipe.module.state_dict():
            dense_key = next(iter(gpt_state_from_sequential({self.pipe.full_key(key): 0}, n_layer)))
            value = state["model"][dense_key]
            owner, _, leaf = key.rpartition(".")
            layer = layers.get(owner)
            if isinstance(layer, _Parallel) and leaf in layer.shard_dims:
                value = shard(value, layer.shard_dims[leaf], self.tp_group, layer.chunks)
            local[key] = value
        self.pipe.module.load_state_dict(local)  # (under ZeRO the slices alias these weights)
        self.optimizer.load_state_dict(state["optimizer"][self.ctx.rank])


def _release_other_stages(layers: nn.Sequential, stage: nn.Module) -> None:
    """Free the storage of the layers other ranks train: this rank keeps only its stage.

    Every rank builds the whole GPT (the same seed gives the same weights everywhere); once cut,
    the tensors of other stages' layers move to the meta device (shape without storage). A
    tensor the stage shares, such as the tied embedding, stays.
    """
    kept = {id(t) for t in list(stage.parameters()) + list(stage.buffers())}
    for owner in layers.modules():
        for name, param in list(owner.named_parameters(recurse=False)):
            if id(param) not in kept:
                setattr(owner, name, nn.Parameter(param.to("meta"), param.requires_grad))
        for name, buffer in list(owner.named_buffers(recurse=False)):
            if id(buffer) not in kept:
                setattr(owner, name, buffer.to("meta"))


def build_pipeline(
    model: nn.Module,
    optimizer_factory: OptimizerFactory,
    ctx: Context,
    *,
    loss_fn: LossFn | None = None,
    grad_clip: float = 0.0,
    policy: PipelinePolicy | None = None,
) -> Engine:
    """Every rank one pipeline stage of the GPT."""
    policy = policy if policy is not None else PipelinePolicy()
    return HybridEngine(
        model,
        optimizer_factory,
        ctx,
        loss_fn=loss_fn,
        grad_clip=grad_clip,
        pp=ctx.world_size,
        num_microbatches=policy.microbatches,
        schedule=policy.schedule,
        policy=policy,
    )


def build_tensor(
    model: nn.Module,
    optimizer_factory: OptimizerFactory,
    ctx: Context,
    *,
    loss_fn: LossFn | None = None,
    grad_clip: float = 0.0,
    policy: TensorPolicy | None = None,
) -> Engine:
    """Every block's attention heads and MLP split over all ranks (Megatron-LM)."""
    return HybridEngine(
        model,
        optimizer_factory,
        ctx,
        loss_fn=loss_fn,
        grad_clip=grad_clip,
        tp=ctx.world_size,
        num_microbatches=1,
        policy=policy if policy is not None else TensorPolicy(),
    )


def build_hybrid(
    model: nn.Module,
    optimizer_factory: OptimizerFactory,
    ctx: Context,
    *,
    loss_fn: LossFn | None = None,
    grad_clip: float = 0.0,
    policy: HybridPolicy | None = None,
) -> Engine:
    """dp x tp x pp (pp 0: the ranks dp and tp leave)."""
    policy = policy if policy is not None else HybridPolicy()
    pp = policy.pp or max(1, ctx.world_size // (policy.dp * policy.tp))
    return HybridEngine(
        model,
        optimizer_factory,
        ctx,
        loss_fn=loss_fn,
        grad_clip=grad_clip,
        dp=policy.dp,
        tp=policy.tp,
        pp=pp,
        zero=policy.zero,
        num_microbatches=policy.microbatches,
        schedule=policy.schedule,
        bucket_cap_mb=policy.bucket_cap_mb,
        policy=policy,
    )
