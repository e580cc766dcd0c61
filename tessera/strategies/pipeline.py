"""Strategies `pipeline` and `hybrid`: any model on a dp x tp x pp mesh, as an Engine.

Order of composition (Megatron-LM, torchtitan): tensor parallelism inside each stage
(`tessera.tensor_parallel.parallelize_model` with the policy's plan, or the model's own: the
reference GPT's), then the model cut into pipeline stages (`tessera.pipeline.Pipeline` over the
pp group: an `nn.Sequential` or a model with a layer view of its own, the GPT's
`tessera.pipeline.gpt.gpt_layers`, by layers; any other model at the `split` modules through
PyTorch's pipeline frontend), then data parallelism over the dp group inside each stage
(`dp_sharding.py`: tessera's DDP reducer or ZeRO-1/2, reducing during the stage's W pass).

Batches: every rank passes its shard of the global batch; the engine all-gathers the shards
(tensors on dim 0, dicts per key) and gives dp replica d rows `[d B/dp, (d+1) B/dp)`, so a step
equals one process on the global batch and the returned loss is the global batch's mean. A dict
batch calls `model(**batch)` and takes `loss_fn(output, batch)`, or the output's own `.loss` /
`["loss"]`; an `(inputs, targets)` pair takes `loss_fn(model(inputs), targets)`.

Memory: every rank builds the whole model; once it is cut (at once for layers, on the first batch
for a traced split) the tensors of other stages move to the meta device, so each rank keeps only
its stage. The optimizer the factory builds holds this rank's stage parameters (a traced split:
built on the whole model, then narrowed to the stage before its first step).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tessera.optim.clip import squared_sum
from tessera.pipeline.chunks import forward_only_interleaved
from tessera.pipeline.dp_sharding import StageDataParallel, StageZero
from tessera.pipeline.evaluate import forward_only
from tessera.pipeline.gpt import gpt_layers
from tessera.pipeline.layers import model_layers
from tessera.pipeline.microbatch import batch_rows, take_rows
from tessera.pipeline.policy import HybridPolicy, PipelinePolicy
from tessera.pipeline.runner import Pipeline
from tessera.runtime.context import Context
from tessera.runtime.mesh import Mesh
from tessera.strategies import batch as rule
from tessera.strategies.batch import LossFn, gather_batch, model_loss, no_loss_message
from tessera.strategies.capabilities import Capabilities, hybrid_layout, pipeline_layout
from tessera.strategies.engine import Engine, OptimizerFactory
from tessera.strategies.precision import DTYPES
from tessera.strategies.registry import declare_strategy
from tessera.strategies.stage_state import held, release_other_stages
from tessera.strategies.step_loss import StepLoss
from tessera.tensor_parallel import full_state_dict, parallelize_model
from tessera.tensor_parallel.layers import _Parallel, shard

__all__ = ["HybridPolicy", "PipelineEngine", "PipelinePolicy", "build_hybrid", "build_pipeline"]


class PipelineEngine(Engine):
    """Data x tensor x pipeline parallel training of any model (`pipeline` and `hybrid`).

    An `Engine` whose step runs every stage's micro-batches (`train_step` is the unit: the
    forward alone is no pipeline step); clipping, precision, save/load/export come from the
    base, over the hooks and the dense state this engine gives. Its optimizer covers this
    rank's stage only (`make_optimizer`). Gradient accumulation is the pipeline's own: with
    `grad_accum` K, `tessera.setup` gives it K times the policy's micro-batches, and one step
    over them reduces the gradients once. `policy`: a `HybridPolicy`, or a `PipelinePolicy`
    (every rank one stage: pp = world).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer_factory: OptimizerFactory,
        ctx: Context,
        *,
        policy: HybridPolicy | PipelinePolicy | None = None,
        **steps: Any,
    ) -> None:
        """`steps`: `Engine`'s cross-cutting keywords (loss_fn, grad_clip, precision, ...)."""
        policy = _as_hybrid(policy, ctx.world_size)
        dp, tp = policy.dp, policy.tp
        pp = policy.pp or max(1, ctx.world_size // (dp * tp))
        if dp * tp * pp != ctx.world_size:
            raise ValueError(f"dp {dp} x tp {tp} x pp {pp} != world size {ctx.world_size}")
        state = model.state_dict(keep_vars=True)
        keys_of: dict[int, list[str]] = {}
        for key, tensor in state.items():
            keys_of.setdefault(id(tensor), []).append(key)
        self._aliases = {key: keys_of[id(t)] for key, t in state.items()}
        """Every state-dict key of the model -> every key of the same tensor (tied), in order."""
        v = policy.virtual_stages
        # the model's own view where it has one (the GPT: embed, blocks, head), else itself
        self.layers = gpt_layers(model, policy.split, pp * v if v > 1 else None) or model_layers(
            model, policy.split
        )
        eager = pp == 1 or self.layers.eager(pp * v)
        self.mesh = Mesh(dp=dp, tp=tp, pp=pp)
        self.tp_group, self.dp_group = self.mesh.group("tp"), self.mesh.group("dp")
        if tp > 1:  # before the cut: the plan replaces modules the stages then hold
            _tensor_parallel(model, policy.plan, eager, self.tp_group, self.layers.own_tp_plan)
        if policy.zero and dp > 1 and not eager:
            raise ValueError(
                f"zero={policy.zero} with a {type(model).__name__} split at {self.layers.split}: "
                "ZeRO builds its optimizer over the stage, known only once traced; use zero=0"
            )
        self.pipe = Pipeline(
            self.layers.sequential(),
            num_microbatches=policy.microbatches,
            schedule=policy.schedule,
            group=self.mesh.group("pp"),
            balance=self.layers.balance,
            split=self.layers.split,
            timeout_s=ctx.timeout_s,
            defer_weight_grads=policy.defer_weight_grads,
            virtual_stages=v,
        )
        self._make_optimizer = optimizer_factory
        self.dp_sync: StageDataParallel | StageZero | None = None
        """Averages (or shards) the stage's gradients over the dp group during the W pass."""
        self._pending_optimizer_state: dict[str, Any] | None = None
        self.params: list[nn.Parameter] = []
        super().__init__(model, optimizer_factory, ctx, policy=policy, **steps)

    def make_optimizer(self, optimizer_factory: OptimizerFactory) -> torch.optim.Optimizer:
        """The stage's optimizer; a split traced on the first batch: the whole model's until
        then, narrowed to the stage in `_adopt_stage`."""
        if self.pipe.ready:
            return self._adopt_stage(None)
        return optimizer_factory(list(self.module.parameters()))

    # ------------------------------------------------------------------------------ setup
    def _adopt_stage(self, built: torch.optim.Optimizer | None) -> torch.optim.Optimizer:
        """Free other stages' tensors, set up the dp reduction, return the stage's optimizer."""
        stage = self.pipe.module
        self._unheld = getattr(self.pipe.stage, "unheld", [])
        """State keys no stage's graph uses (a traced split), kept here on stage 0."""
        state = self.module.state_dict(keep_vars=True)
        release_other_stages(self.module, [stage, *[state[k] for k in self._unheld]])
        self.params = list(stage.parameters())
        split_ids = {
            id(getattr(m, name))
            for m in stage.modules()
            if isinstance(m, _Parallel)
            for name in m.shard_dims
        }
        # A parameter counts in the global gradient norm once: tensor-parallel shards on every tp
        # rank, replicated ones on tp rank 0 only, tied ones on their first stage only.
        tp_rank = self.mesh.rank("tp")
        self._norm_weight = [
            float(self.pipe.counts_in_norm(p) and (id(p) in split_ids or tp_rank == 0))
            for p in self.params
        ]
        dp = self.mesh.size("dp")
        if self.policy.zero and dp > 1:
            self.dp_sync = StageZero(
                stage,
                self._make_optimizer,
                stage=self.policy.zero,
                group=self.dp_group,
                norm_weight={id(p): w for p, w in zip(self.params, self._norm_weight)},
                bucket_cap_mb=self.policy.bucket_cap_mb,
            )
            self.dp_sync.find_unused_parameters = self.policy.find_unused_parameters
            return self.dp_sync.optimizer
        if dp > 1:
            self.dp_sync = StageDataParallel(
                stage,
                group=self.dp_group,
                bucket_cap_mb=self.policy.bucket_cap_mb,
                timeout_s=self.ctx.timeout_s,
            )
            self.dp_sync.find_unused_parameters = self.policy.find_unused_parameters
            if self.precision in DTYPES:  # (a traced split: cut after use_precision)
                self.reduce_gradients_in(DTYPES[self.precision])
        if built is None:
            return self._make_optimizer(self.params)
        mine = {id(p) for p in self.params}
        for group in built.param_groups:  # no step taken yet: the state is empty
            group["params"] = [p for p in group["params"] if id(p) in mine]
        if self._pending_optimizer_state is not None:
            built.load_state_dict(self._pending_optimizer_state)
            self._pending_optimizer_state = None
        return built

    def reduce_gradients_in(self, dtype: torch.dtype) -> None:
        """Average the stage's gradients over the dp group in `dtype` (tessera's DDP buckets;
        ZeRO inside the stages reduces fp32). A traced split: once cut (`_adopt_stage`)."""
        if isinstance(self.dp_sync, StageDataParallel):
            self.dp_sync.ddp.reduce_in(dtype)

    @property
    def zero(self) -> StageZero | None:
        """The ZeRO sharding of this rank's stage over its dp group, if any."""
        return self.dp_sync if isinstance(self.dp_sync, StageZero) else None

    # ----------------------------------------------------------------------------- a step
    def _replica_rows(self, batch: Any) -> tuple[Any, Any, LossFn]:
        """Gather the global batch, keep this dp replica's rows, cut the stages if not yet."""
        dp = self.mesh.size("dp")
        if self.ctx.world_size > 1:
            batch = gather_batch(batch)
        rows = batch_rows(batch)
        if rows % dp:
            raise ValueError(f"global batch of {rows} rows does not split over dp={dp}")
        d, share = self.mesh.rank("dp"), rows // dp
        self._whole_targets = self._loss_parts(batch)[1] if dp > 1 else None  # (train_step)
        inputs, targets, loss_fn = self._loss_parts(take_rows(batch, d * share, (d + 1) * share))
        if not self.pipe.ready:
            self.pipe.prepare(inputs)
            self.optimizer = self._adopt_stage(self.optimizer)
            fields = getattr(self.pipe.stage, "output_fields", ["loss"])
            if isinstance(batch, Mapping) and self.loss_fn is None and "loss" not in fields:
                raise ValueError(no_loss_message(type(self.module).__name__))  # every rank, at once
        return inputs, targets, loss_fn

    def train_step(self, batch: Any) -> StepLoss:
        """Forward and backward of the global batch (this rank passes its shard); its mean loss
        (the dp replicas' means averaged without waiting, `StepLoss`)."""
        inputs, targets, loss_fn = self._replica_rows(self.as_pair(batch))
        # fp16: the last stage's loss is scaled (`Engine.scaled`) before its backward; the mean
        # returned unscaled (the scale is a power of two: exact)
        scale = self.loss_scale or 1.0
        if self.loss_scaler is not None:
            loss_fn = _scaled_loss(loss_fn, self.scaled)
        counter = rule.item_counter(self.loss_fn, self.module)  # micro-batches by their items
        whole = self._whole_targets  # dp replicas averaged: each weighs by its items too
        total = counter(whole) if counter and whole is not None else None
        total = total / self.mesh.size("dp") if total else None
        loss_fn = rule.items_weighted(loss_fn, counter, targets, total)
        if self.dp_sync is None:
            with self.autocast():
                return StepLoss(self.pipe.train_step(inputs, targets, loss_fn) / scale)
        # the dp reduction runs during the W pass, bucket by bucket as the gradients complete
        with self.autocast():
            loss = self.pipe.train_step(
                inputs, targets, loss_fn, before_weight_pass=self.dp_sync.arm
            )
        self.comm_seconds = self.dp_sync.finish()
        return StepLoss.mean_over(torch.tensor(loss / scale), self.dp_group)

    def _eval_modules(self) -> list[nn.Module]:
        """The model and this rank's stage (a traced stage is a module of its own); none before
        a traced split is cut: its training graph is traced in the modes the user left (its
        evaluation graph in eval mode, `tessera.pipeline.trace`)."""
        return [self.module, self.pipe.module] if self.pipe.ready else []

    def _eval_loss(self, batch: Any) -> float:
        """Forward only through the stages (`tessera.pipeline.evaluate`): the global batch's
        mean loss on every rank, averaged over the dp replicas' rows."""
        inputs, targets, loss_fn = self._replica_rows(batch)
        evaluate = forward_only_interleaved if self.pipe.virtual_stages > 1 else forward_only
        with self.autocast():
            loss = evaluate(self.pipe, inputs, targets, loss_fn)
        dp = self.mesh.size("dp")
        if dp == 1:
            return loss
        return float(StepLoss.mean_over(torch.tensor(loss), self.dp_group))  # on its device

    def _loss_parts(self, batch: Any) -> tuple[Any, Any, LossFn]:
        """(what the model is called with, what the loss compares with, the loss)."""
        if isinstance(batch, Mapping):
            if self.loss_fn is not None:
                return batch, batch, self.loss_fn
            name = type(self.module).__name__
            return batch, batch, lambda output, _batch: model_loss(output, name)
        if isinstance(batch, (tuple, list)) and len(batch) == 2:
            if self.loss_fn is None:
                raise ValueError("an (inputs, targets) batch needs loss_fn(output, targets)")
            return batch[0], batch[1], self.loss_fn
        raise ValueError(f"a batch is a dict or an (inputs, targets) pair, not {type(batch)}")

    def squared_norm_share(self) -> torch.Tensor | None:
        """The global norm's share of this rank (summed over the world group by
        `Engine.reduce_squared_norm`): under ZeRO its slices of the stage's averaged gradients;
        else dp rank 0 counts the stage (dp replicas hold equal gradients after averaging),
        replicated and tied parameters once. None before a traced split is cut: every rank
        then holds the whole model (no step has made gradients)."""
        if not self.pipe.ready:
            return None
        if self.zero is not None:  # each dp rank holds a distinct slice of the averaged grads
            return self.zero.grad_norm_sq()
        weights = self._norm_weight if self.mesh.rank("dp") == 0 else [0.0] * len(self.params)
        return squared_sum(self.local_gradients(), weights)

    def optimizer_step(self) -> None:
        """The stage's optimizer step (under ZeRO: its slices, then all-gathered), zero_grad."""
        if self.zero is not None:
            self.zero.step()
        else:
            super().optimizer_step()

    def local_gradients(self) -> list[torch.Tensor | None]:
        """This rank's stage gradients (under ZeRO its reduced slices): what its step reads."""
        if self.zero is not None:
            return list(self.zero.inner.gradient_slices())
        return [p.grad for p in self.params]

    def discard_gradients(self) -> None:
        """Forget this step's gradients without stepping (a skipped fp16 step)."""
        if self.zero is not None:
            self.zero.inner.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)

    # --------------------------------------------------------------------------- state
    def model_state_bytes(self) -> int:
        """Bytes of this rank's parameters, gradients and optimizer state (its stage only)."""
        if self.zero is not None:
            return self.zero.model_state_bytes()
        params = self.params if self.pipe.ready else list(self.module.parameters())
        tensors = [p for p in params] + [p.grad for p in params if p.grad is not None]
        for state in self.optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The dense model's state dict with the model's own keys, on every rank; collective."""
        if not self.pipe.ready:  # not cut yet: every rank holds the whole model
            return {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()}
        stage = self.pipe.module
        if self.mesh.size("tp") > 1:
            stage_state = full_state_dict(stage, group=self.tp_group)
        else:
            stage_state = stage.state_dict()
        own = self.module.state_dict()
        stage_state = {**stage_state, **{key: own[key] for key in self._unheld}}
        state = self.layers.model_keys(self.pipe.full_state_dict(stage_state=stage_state))
        # copies: on one stage nothing was gathered, and a payload must not follow the training
        # a tied tensor under whichever of its names a stage holds (T5: `shared.weight` is held
        # as `encoder.embed_tokens.weight` and `lm_head.weight`)
        return {key: held(state, names).clone() for key, names in self._aliases.items()}

    def full_key(self, stage_key: str) -> str:
        """The model's own state-dict key of this rank's stage key `stage_key`."""
        return next(iter(self.layers.model_keys({self.pipe.full_key(stage_key): 0})))

    def state_dict(self) -> dict[str, Any]:
        """Dense model and every rank's optimizer state (list by global rank); collective."""
        optimizers: list[Any] = [None] * self.ctx.world_size
        if self.ctx.world_size > 1:
            dist.all_gather_object(optimizers, self.optimizer.state_dict())
        else:
            optimizers = [copy.deepcopy(self.optimizer.state_dict())]  # not the live state
        return self.precision_state({"model": self.full_state_dict(), "optimizer": optimizers})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Slice the dense model into this rank's stage and shards; take this rank's optimizer."""
        if len(state["optimizer"]) != self.ctx.world_size:
            raise ValueError(
                f"checkpoint holds {len(state['optimizer'])} ranks' optimizers, "
                f"this run has {self.ctx.world_size} ranks"
            )
        mine = state["optimizer"][self.ctx.rank]
        self.load_precision_state(state)
        if not self.pipe.ready:  # the whole model is still here; the optimizer after the cut
            self.module.load_state_dict(state["model"])
            self._pending_optimizer_state = mine
            return
        stage = self.pipe.module
        layers = dict(stage.named_modules())
        local = {}
        for key, current in stage.state_dict().items():
            full = self.full_key(key)
            if full not in self._aliases:  # a constant the trace lifted: not the model's state
                local[key] = current
                continue
            value = held(state["model"], self._aliases[full])
            owner, _, leaf = key.rpartition(".")
            layer = layers.get(owner)
            if isinstance(layer, _Parallel) and leaf in layer.shard_dims:
                value = shard(value, layer.shard_dims[leaf], self.tp_group, layer.chunks)
            local[key] = value
        stage.load_state_dict(local)  # (under ZeRO the slices alias these weights)
        own = self.module.state_dict(keep_vars=True)
        with torch.no_grad():
            for key in self._unheld:
                own[key].copy_(state["model"][key])
        self.optimizer.load_state_dict(mine)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Not a pipeline step: the stages run forward and backward together in `train_step`."""
        raise NotImplementedError("a pipeline runs forward and backward together: train_step")

    def close(self) -> None:
        """Close the links to the neighbouring stages."""
        if self.pipe.links is not None:
            self.pipe.links.close()


def _tensor_parallel(
    model: nn.Module,
    plan: Mapping[str, str] | None,
    eager: bool,
    group: dist.ProcessGroup,
    own_plan: bool = False,
) -> None:
    """Apply the plan (or the model's own: `own_plan`) before the model is cut; refuse a
    traced split."""
    name = type(model).__name__
    if not eager:
        raise ValueError(
            f"tp > 1 with a {name} split at named modules: traced stages run ATen graphs, not "
            "the modules a plan replaces; split an nn.Sequential at its layers, or use pp=1"
        )
    if plan is None and not own_plan:
        raise ValueError(f"tp > 1 on a {name} needs plan={{module-name pattern: style}}")
    parallelize_model(model, plan, group=group)


def _scaled_loss(loss_fn: LossFn, scaled: Callable[[torch.Tensor], torch.Tensor]) -> LossFn:
    """`loss_fn` then `scaled` (the engine's fp16 loss scaling): the pipeline runs backward on
    what the loss returns."""

    def scaled_loss(output: Any, targets: Any) -> torch.Tensor:
        return scaled(loss_fn(output, targets))

    return scaled_loss


def _as_hybrid(policy: HybridPolicy | PipelinePolicy | None, world_size: int) -> HybridPolicy:
    """The `pipeline` strategy's policy as the hybrid's with every rank one stage (pp = world);
    None: `HybridPolicy()`."""
    if not isinstance(policy, PipelinePolicy):
        return policy or HybridPolicy()
    return HybridPolicy(pp=world_size, pipeline=policy)


build_pipeline = build_hybrid = PipelineEngine
"""The builders of `pipeline` (a `PipelinePolicy`: every rank one stage) and `hybrid`."""

_MODEL_PARALLEL = Capabilities(
    not_compilable="it cuts the model into stages by running its modules one by one",
    activation_checkpointing=False,  # (it splits the GPT its own way)
    frees_gradients=True,
)
declare_strategy(
    "pipeline",
    PipelineEngine,
    policy=PipelinePolicy,
    capabilities=dataclasses.replace(
        _MODEL_PARALLEL,
        layout=pipeline_layout,
        world_bound="its optimizer state is split by pipeline stage",
    ),
)
declare_strategy(
    "hybrid",
    PipelineEngine,
    policy=HybridPolicy,
    capabilities=dataclasses.replace(
        _MODEL_PARALLEL,
        layout=hybrid_layout,
        world_bound="its parameters and optimizer state are split by stage and tensor-parallel "
        "rank",
    ),
)
