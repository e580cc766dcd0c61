"""The Engine protocol: what a training script (and the trainer) drives, whatever the strategy.

    engine = tessera.setup(model, lambda params: torch.optim.AdamW(params, lr=1e-3), strategy=...)
    scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, schedule)   # optional
    for batch in batches:
        loss = engine.train_step(batch)    # forward and backward; the global mean, read lazily
        engine.step()                      # clip (grad_clip > 0), optimizer step, zero_grad
        scheduler.step()
    val_loss = engine.eval_step(held_out_batch)   # forward only: training is left as it was

Mixed precision (`setup(..., precision="bf16" | "fp16")`, see `tessera.strategies.precision`):
`train_step` computes the loss under autocast, `backward` scales it (fp16), and `step` unscales
the gradients and skips the step on inf/nan on any rank (`loss_scale`, `skipped_steps`).

`train_step` is one unit (not forward, then backward) because a pipeline interleaves the
forwards and backwards of its micro-batches inside one step, and because gradient accumulation
(`tessera.setup(..., grad_accum=K)`) runs K forward/backward passes inside it: the rank's batch is
cut into K micro-batches, each loss weighted by its share of what the loss averages over (the
rows, or the tokens not ignored: `tessera.strategies.batch.item_counter`; so the gradient is the
whole batch's), and the gradients are reduced over ranks once, in the last backward (the others
run under `no_sync()`). The batch follows the batch rule of `tessera.strategies.batch`.
`engine.optimizer` is a real `torch.optim.Optimizer` (under ZeRO the one over this rank's
shards), and `step` uses the learning rate in its `param_groups`, so a torch learning-rate
scheduler works unchanged.

This base class is the `single` strategy (one process, no communication: the reference every
other strategy equals); adapters override what their strategy changes. The cross-cutting steps
are written here once, and a strategy gives only hooks: `make_optimizer` (over what this rank
steps), `local_gradients` (what its step reads), `squared_norm_share` and `reduce_squared_norm`
(its share of the squared global norm and how the shares add up over its groups: clipping),
`reduce_gradients_in` (the dtype its gradient reduction uses: precision), `no_sync` (what
accumulation runs the first micro-batches under), `discard_gradients` (a skipped fp16 step). An
engine is built whole in one step: `tessera.setup` hands every setting to the constructor.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tessera.checkpoint.atomic import write_atomically
from tessera.data.loader import select_keys
from tessera.optim.clip import clip_grad_norm, sum_over
from tessera.optim.loss_scale import DynamicLossScaler
from tessera.runtime.context import Context
from tessera.runtime.scalar import DeviceScalar
from tessera.strategies.batch import (
    Batch,
    LossFn,
    compute_loss,
    is_one,
    item_counter,
    items_share,
    split_for_accumulation,
)
from tessera.strategies.evaluation import evaluating
from tessera.strategies.precision import DTYPES, autocast_context, sum_flag
from tessera.strategies.step_loss import StepLoss

__all__ = ["ENGINE_FILE", "Engine", "NoOptions", "OptimizerFactory"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
"""`params -> torch.optim.Optimizer`: the engine decides over which parameters (shards, stages)."""

ENGINE_FILE = "engine.pt"
"""The file `Engine.save` writes into its folder (a plain `torch.save` file), beside any shards."""


@dataclass(kw_only=True, frozen=True)
class NoOptions:
    """The policy of a strategy without knobs (single, torch-ddp): no option is accepted."""


class Engine:
    """One process, no communication (`strategy="single"`); the base of every engine.

    `module` is the user's model (its weights are the trained ones wherever the strategy keeps
    them whole), `optimizer` the optimizer `optimizer_factory` built over what this rank steps.
    """

    sharded_checkpoint = False
    """True where every rank writes files of its own in `save` (ZeRO's shards)."""
    precision = "fp32"
    """`fp32`, `bf16` or `fp16` (set by `use_precision`, which `__init__` calls)."""
    loss_scaler: DynamicLossScaler | None = None
    """fp16's dynamic loss scaler, or None."""
    autocast_dtype: torch.dtype | None = None
    """The dtype `train_step` autocasts to; None where the strategy keeps low-precision weights
    itself (ZeRO's bf16) or under fp32."""

    grad_accum = 1
    """Micro-batches per `train_step` (gradient accumulation), from the constructor."""
    strategy_name: str | None = None
    """The strategy `tessera.setup` built this engine for; `save` records it, `load` names it."""
    items_over_ranks = False
    """True where each rank computes on its own part of the global batch and the gradients are
    averaged over all ranks (data parallelism): a loss averaged over items is then weighted by
    this rank's share of the global batch's items (`_items_scale`)."""

    def __init__(
        self,
        module: nn.Module,
        optimizer_factory: OptimizerFactory | None,
        ctx: Context,
        *,
        loss_fn: LossFn | None = None,
        grad_clip: float = 0.0,
        grad_accum: int = 1,
        precision: str = "fp32",
        loss_scaler: DynamicLossScaler | None = None,
        policy: Any = None,
        optimizer: torch.optim.Optimizer | None = None,
        batch_keys: tuple[tuple[str, ...], tuple[str, ...]] | None = None,
        strategy_name: str | None = None,
    ) -> None:
        """Build the engine whole: `tessera.setup` passes every cross-cutting setting here.

        Why so many parameters: each keyword is a step every strategy takes the same way (loss,
        clip, accumulation, precision, batch keys), done here once; a subclass takes its own
        knobs from `policy` and hands the rest on as `**steps`. `optimizer`: one the strategy
        built itself (ZeRO's over its shards); else `make_optimizer(optimizer_factory)`.
        """
        if isinstance(grad_clip, bool) or not grad_clip >= 0:
            raise ValueError(f"grad_clip must be >= 0 (0 turns clipping off), got {grad_clip!r}")
        self.module = module
        """The user's model object."""
        self.ctx = ctx
        self.loss_fn = loss_fn
        """`loss_fn(output, targets | batch)`, or None: dict batches then use the model's loss."""
        self.grad_clip = float(grad_clip)
        """`step` clips the global gradient norm to this first; 0: no clipping."""
        self.grad_accum = grad_accum
        self.batch_keys = batch_keys
        self.strategy_name = strategy_name
        self.policy = policy if policy is not None else NoOptions()
        """The strategy's options (a frozen policy dataclass)."""
        self.comm_seconds = 0.0
        """Communication the last step waited for (not hidden behind compute), in seconds."""
        if optimizer is None:
            if optimizer_factory is None:
                raise ValueError("an engine needs an optimizer factory (params -> Optimizer)")
            optimizer = self.make_optimizer(optimizer_factory)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"the optimizer factory must return a torch.optim.Optimizer, got "
                f"{type(optimizer).__name__}"
            )
        self.optimizer = optimizer
        """A `torch.optim.Optimizer`; the lr in its `param_groups` is the one `step` uses."""
        if precision != "fp32":  # a policy with its own low precision (ZeRO's) does not autocast
            own = getattr(self.policy, "mixed_precision", None) is not None
            self.use_precision(precision, loss_scaler, autocast=not own)

    def make_optimizer(self, optimizer_factory: OptimizerFactory) -> torch.optim.Optimizer:
        """The optimizer over what this rank steps: here the whole model's parameters (a
        pipeline: its stage's). Called once, by `__init__`."""
        return optimizer_factory(self.module.parameters())

    # -- precision -----------------------------------------------------------------------------
    def use_precision(
        self, precision: str, loss_scaler: DynamicLossScaler | None = None, *, autocast: bool = True
    ) -> None:
        """Train in `precision` from now on (`__init__` calls this once, before any step).

        `autocast=False`: the strategy's weights are already in the low dtype (ZeRO's bf16).
        fp16 gets `loss_scaler` (default: a `DynamicLossScaler` with GradScaler's defaults).
        Gradients are communicated in the low dtype where the strategy communicates them
        (`reduce_gradients_in`).
        """
        self.precision = precision
        self.autocast_dtype = DTYPES.get(precision) if autocast else None
        if precision == "fp16":
            self.loss_scaler = loss_scaler if loss_scaler is not None else DynamicLossScaler()
        if precision in DTYPES:
            self.reduce_gradients_in(DTYPES[precision])

    def reduce_gradients_in(self, dtype: torch.dtype) -> None:
        """Hook: reduce gradients over ranks in `dtype` from now on (mixed precision); the
        strategies that average gradients with their own buckets override it. Here: nothing is
        communicated."""

    @property
    def loss_scale(self) -> float | None:
        """The fp16 loss scale the next backward uses; None without fp16."""
        return self.loss_scaler.scale if self.loss_scaler is not None else None

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for an inf/nan gradient (fp16) since the run began."""
        return self.loss_scaler.skipped if self.loss_scaler is not None else 0

    def autocast(self) -> Any:
        """The context `train_step` computes the loss in: autocast to the low dtype, or none."""
        return autocast_context(self.ctx.device, self.autocast_dtype)

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` times the fp16 loss scale (what backward runs on); `loss` itself otherwise."""
        return self.loss_scaler.scale_loss(loss) if self.loss_scaler is not None else loss

    def local_gradients(self) -> list[torch.Tensor | None]:
        """The gradients this rank's optimizer step reads (ZeRO: its reduced slices)."""
        return [p.grad for p in self.module.parameters()]

    def discard_gradients(self) -> None:
        """Forget this step's gradients without stepping (a skipped fp16 step)."""
        self.optimizer.zero_grad(set_to_none=True)

    def unscale_or_skip(self) -> bool:
        """fp16: unscale the gradients and decide over every rank; False (gradients discarded,
        scale halved) when any rank holds an inf/nan. True without a loss scaler. Collective.

        Where the optimizer skips on the device (`_skips_on_device`), nothing is read."""
        if self.loss_scaler is None:
            return True
        if self._skips_on_device():
            found_inf = self.loss_scaler.unscale_and_flag(self.local_gradients(), sum_flag)
            self.loss_scaler.update_on_device(found_inf)
            self.optimizer.grad_scale, self.optimizer.found_inf = None, found_inf
            return True
        found_inf = self.loss_scaler.unscale_and_check(self.local_gradients(), sum_flag)
        self.loss_scaler.update(found_inf)
        if found_inf:
            self.discard_gradients()
        return not found_inf

    # -- training ------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward as this strategy runs it (wrapped by DDP, say)."""
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward (of the fp16-scaled loss); after it every gradient this rank steps is the
        one the optimizer uses."""
        self.scaled(loss).backward()

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backwards inside keep their gradients on this rank (added up); the first backward
        after it reduces the sum over ranks. Strategies that reduce gradients override it."""
        return contextlib.nullcontext()

    def _micro_loss(self, micro: Batch) -> torch.Tensor:
        """The loss of one micro-batch under the batch rule (every forward of a step runs here),
        computed under the engine's autocast (`precision`)."""
        with self.autocast():
            return compute_loss(
                self.forward, micro, self.loss_fn, model_name=type(self.module).__name__
            )

    batch_keys: tuple[tuple[str, ...], tuple[str, ...]] | None = None
    """`setup(input_keys=, target_keys=)`: dict batches become `(inputs, targets)` pairs by
    these keys before the batch rule (`as_pair`); None: batches are taken as they come."""

    def as_pair(self, batch: Batch) -> Batch:
        """`batch` by `batch_keys` (`tessera.data.loader.select_keys`), or as it is."""
        return batch if self.batch_keys is None else select_keys(batch, *self.batch_keys)

    def train_step(self, batch: Batch) -> StepLoss:
        """Forward and backward of this rank's `batch` (the batch rule); return the loss.

        The loss is the global batch's mean under every strategy (here: the mean over the ranks
        of each rank's batch mean, weighed by the rank's items where they are counted), as a
        `StepLoss`: read from the device when
        used (`float(loss)`, printing), so the step itself never waits for the device; its
        all-reduce over ranks runs asynchronously meanwhile.
        With `grad_accum` K > 1 the batch is cut into K micro-batches (`split_for_accumulation`),
        each backward takes its loss times its share of the items (rows, or tokens counted), all
        but the last run under `no_sync()`, and the returned loss is the shares' weighted mean:
        the whole batch's. Data-parallel engines also weigh the ranks by their items.
        """
        batch = self.as_pair(batch)
        count = item_counter(self.loss_fn, self.module)
        parts = split_for_accumulation(batch, self.grad_accum, count)
        scale = self._items_scale(batch, item_counter(self.loss_fn, self.module, on_device=True))
        total: torch.Tensor | None = None
        for index, (micro, share) in enumerate(parts):
            last = index == len(parts) - 1
            with contextlib.nullcontext() if last else self.no_sync():
                loss = self._micro_loss(micro)
                weight = scale if share == 1.0 else share * scale
                self.backward(loss if is_one(weight) else loss * weight)
            # stays on the device (no sync per step); a factor of 1 costs no operator
            weighted = loss.detach().float()
            weighted = weighted if share == 1.0 else weighted * share
            total = weighted if total is None else total + weighted
        assert total is not None  # split_for_accumulation yields at least one part
        # ranks weighed by their items (scale): the mean over ranks is the global batch's loss
        return self.global_loss(total if is_one(scale) else total * scale)

    loss_is_global = False
    """True where `train_step` computes the loss of the global batch on every rank (tensor):
    nothing to average then."""

    def global_loss(self, local: torch.Tensor) -> StepLoss:
        """The global batch's mean from this rank's batch mean `local`: averaged over the ranks
        (asynchronously, `StepLoss.mean_over`) unless `loss_is_global`. Collective."""
        if self.loss_is_global or self.ctx.world_size == 1:
            return StepLoss(local)
        return StepLoss.mean_over(local)

    def _items_scale(self, batch: Batch, count: Any) -> float | torch.Tensor:
        """Data parallelism averages the ranks' gradients; where the loss averages over items
        that differ in number between ranks (tokens not ignored), this rank's loss is weighed by
        its share of them (`items_share`, on the device), so the average is the global batch's
        loss (as Hugging Face's `average_tokens_across_devices`); 1.0 otherwise."""
        if not self.items_over_ranks or self.ctx.world_size == 1 or count is None:
            return 1.0
        return items_share(batch, count, self.ctx.world_size, self.ctx.device, sum_flag)

    def eval_step(self, batch: Batch) -> float:
        """The loss of `batch` without training: the float `train_step` would return for it.

        Forward only, under `torch.no_grad()`, with the model in eval mode for the call (each
        module's mode restored after) and the RNG states saved and restored: no gradient, no
        optimizer state and no random stream of training is touched, so a run that evaluates
        equals one that does not, bit for bit. Data-parallel strategies return this rank's
        batch's loss (average over ranks for the global one, which `train_step` returns);
        tensor, pipeline and hybrid gather the ranks' shards and return the global batch's mean
        loss on every rank. Collective wherever `train_step` is: every rank calls it.
        """
        with evaluating(*self._eval_modules()):
            return self._eval_loss(self.as_pair(batch))

    def _eval_modules(self) -> list[nn.Module]:
        """The modules `eval_step` puts into eval mode."""
        return [self.module]

    def _eval_loss(self, batch: Batch) -> float:
        """Forward of `batch` through the user's module itself (not a DDP wrapper, whose forward
        would prepare a gradient reduction); ZeRO-3's hooks gather the parameters as in training."""
        name = type(self.module).__name__
        with self.autocast():
            return float(compute_loss(self.module, batch, self.loss_fn, model_name=name))

    # -- clipping: the global gradient norm from each strategy's share -----------------------
    def squared_norm_share(self) -> torch.Tensor | None:
        """Hook: this rank's share of the squared global gradient norm, each element counted
        once over the ranks `reduce_squared_norm` sums over (`tessera.optim.clip.squared_sum`).
        None (here): the rank holds the whole gradient (one process, data parallelism's averaged
        gradients), clipped by torch's own `clip_grad_norm_`, as in a plain loop."""
        return None

    def reduce_squared_norm(self, total: torch.Tensor) -> torch.Tensor:
        """Hook: the sum of the ranks' `squared_norm_share`s (collective over every rank that
        holds part of the gradient; here the world group, on its device). Called only with
        more than one rank."""
        return sum_over(None)(total)

    def clip_grad_norm(self, max_norm: float) -> DeviceScalar:
        """Scale this rank's `local_gradients` so the global norm is at most `max_norm`; return
        the norm before (read when used: `step` clips without waiting for it). Every engine's
        one clipping, over its hooks; collective where the gradient is split."""
        share = self.squared_norm_share()
        if share is None:
            return DeviceScalar(nn.utils.clip_grad_norm_(self.module.parameters(), max_norm))
        reduce = self.reduce_squared_norm if self.ctx.world_size > 1 else None
        grads = self.local_gradients()
        return clip_grad_norm(grads, max_norm, local_sq_sum=share, all_reduce=reduce)

    def step(self) -> None:
        """Clip (if `grad_clip` > 0), step the optimizer at its own lr, clear the gradients.

        fp16: first unscale; on an inf/nan on any rank skip the whole step (`unscale_or_skip`).
        """
        if not self.unscale_or_skip():
            return
        try:
            if self.grad_clip > 0:
                self.clip_grad_norm(self.grad_clip)  # (a skipped step's nan norm changes nothing)
            self.optimizer_step()
        finally:  # a found_inf is for this step only (GradScaler removes it the same way)
            for name in ("grad_scale", "found_inf"):
                self.optimizer.__dict__.pop(name, None)

    def _skips_on_device(self) -> bool:
        """fp16 without a host sync: where the optimizer's step takes `found_inf` (torch's fused
        Adam, AdamW, SGD) and the engine's step is that step and `zero_grad` alone (ZeRO says so
        itself); strategies doing more (local SGD counts, a pipeline) read the flag on the host."""
        return bool(getattr(self.optimizer, "_step_supports_amp_scaling", False)) and (
            type(self).optimizer_step is Engine.optimizer_step
        )

    def optimizer_step(self) -> None:
        """The optimizer's step and `zero_grad` (what strategies change after clipping)."""
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def model_state_bytes(self) -> int | None:
        """Bytes of parameters, gradients and optimizer state this rank holds, if measured."""
        return None

    # -- state ---------------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state (the keys of `module.state_dict()`) on every rank; collective
        where the strategy splits the model."""
        return {key: value.detach().clone() for key, value in self.module.state_dict().items()}

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint payload: model and optimizer state (collective; complete on rank 0)."""
        model, optimizer = self.module.state_dict(), self.optimizer.state_dict()
        return self.precision_state({"model": model, "optimizer": optimizer})

    def precision_state(self, payload: dict[str, Any]) -> dict[str, Any]:
        """`payload` with the fp16 loss scaler's state added (the same on every rank)."""
        if self.loss_scaler is None:
            return payload
        return {**payload, "loss_scaler": self.loss_scaler.state_dict()}

    def load_precision_state(self, payload: dict[str, Any]) -> None:
        """Restore the loss scaler from `payload` (a payload without one keeps the fresh scale:
        a checkpoint from an fp32/bf16 run)."""
        if self.loss_scaler is not None and "loss_scaler" in payload:
            self.loss_scaler.load_state_dict(payload["loss_scaler"])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (every rank loads the same payload)."""
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.load_precision_state(state)

    def save_files(self, folder: Path) -> dict[str, Any]:
        """Collective: write this rank's own files into `folder` (sharded strategies) and return
        the payload rank 0 stores (by default `state_dict()`, which holds everything, and the
        fp16 loss scaler's state)."""
        return self.precision_state(self.state_dict())

    def load_files(self, folder: Path, payload: dict[str, Any]) -> None:
        """Restore from `payload` and the files `save_files` wrote into `folder`."""
        self.load_state_dict(payload)
        self.load_precision_state(payload)

    def save(self, folder: str | Path) -> Path:
        """Collective: save the engine into `folder` (created): `engine.pt`, a plain
        `torch.save` file written by rank 0, and the strategy's shard files, if any."""
        folder = Path(folder)
        if self.ctx.is_main:
            folder.mkdir(parents=True, exist_ok=True)
        self._barrier()
        payload = self.save_files(folder)
        if self.strategy_name is not None:
            payload = {**payload, "strategy": self.strategy_name}
        if self.ctx.is_main:
            buffer = io.BytesIO()
            torch.save(payload, buffer)
            write_atomically(folder / ENGINE_FILE, lambda file: file.write(buffer.getvalue()))
        self._barrier()
        return folder

    def load(self, folder: str | Path) -> None:
        """Collective: restore what `save(folder)` wrote (every rank reads `engine.pt`)."""
        folder = Path(folder)
        path = folder / ENGINE_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: not a folder written by Engine.save")
        payload = torch.load(path, map_location="cpu", weights_only=True)
        try:
            self.load_files(folder, payload)
        except KeyError as exc:  # every rank reads the same payload: all raise, none waits
            saved = payload.get("strategy", "another strategy")
            mine = self.strategy_name or type(self).__name__
            raise ValueError(
                f"{folder} was saved by {saved}, whose files this {mine} engine cannot read (it "
                f"looks for {exc}); load it with strategy {saved}, or start this engine from its "
                "model weights (`full_state_dict()` there, `load_state_dict` into the model "
                "before tessera.setup)"
            ) from None
        self._barrier()

    def export(self, path: str | Path, format: str = "safetensors") -> Path:
        """Collective: write the full model to `path` as `safetensors` (one file) or `hf` (a
        Hugging Face folder, for a `PreTrainedModel`); rank 0 writes it."""
        from tessera.checkpoint.export import EXPORT_FORMATS, export_model

        # checked on every rank, before the collective: one rank's error must not hang the rest
        if format not in EXPORT_FORMATS:
            raise ValueError(f"unknown export format {format!r}; choose one of {EXPORT_FORMATS}")
        if format == "hf" and not hasattr(self.module, "save_pretrained"):
            raise ValueError(
                f"format 'hf' needs a Hugging Face model (save_pretrained); "
                f"{type(self.module).__name__} has none: export it as 'safetensors'"
            )
        state = self.full_state_dict()
        if self.ctx.is_main:
            export_model(self.module, state, path, format)
        self._barrier()
        return Path(path)

    def close(self) -> None:
        """Release what outlives training (offload files, background steps)."""

    def _barrier(self) -> None:
        if self.ctx.world_size > 1:
            dist.barrier()
