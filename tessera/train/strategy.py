"""The strategy interface: what the training loop drives, whatever splits the work underneath.

A strategy is a function `(module, make_optimizer, context, config) -> Engine`. It receives a plain
`nn.Module` (same initial weights on every rank), a factory that builds an optimizer over the
parameters it is given, this rank's `Context` and the run's `TrainConfig` (for its own knobs, such
as `bucket_cap_mb`), and returns an `Engine`, which the loop uses as

    loss = engine.train_step(inputs, targets, loss_fn)   # forward and backward
    engine.clip_grad_norm(max_norm); engine.step(lr)

and checkpoints through `engine.state_dict()` / `engine.load_state_dict()`. The loop never asks
which strategy runs. `train_step` is the unit (not separate forward and backward) because a
pipeline interleaves the forwards and backwards of micro-batches inside one step.
Strategies are named in `tessera.train.registry` (tessera's own as "module:attribute" strings, so
this module never imports the engines that subclass `Engine`); users add theirs with
`@register_strategy(name)`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tessera.runtime.context import Context
from tessera.train.registry import STRATEGIES, register_strategy

if TYPE_CHECKING:
    from tessera.train.config import TrainConfig

__all__ = [
    "STRATEGIES",
    "Engine",
    "LossFn",
    "OptimizerFactory",
    "TorchDDPEngine",
    "register_strategy",
]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
StrategyFactory = Callable[[nn.Module, OptimizerFactory, Context, Any], "Engine"]
LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


class Engine:
    """One process, no communication: the reference every other strategy must equal.

    Subclasses override what their strategy changes; the defaults here are plain PyTorch.
    """

    sharded_checkpoint = False
    """True: every rank writes and reads its own shard (`save_shards` / `load_shards`) instead
    of rank 0 writing `state_dict()`."""

    def __init__(
        self,
        module: nn.Module,
        make_optimizer: OptimizerFactory,
        ctx: Context,
        config: TrainConfig | None = None,
    ) -> None:
        self.module = module
        """The user's model, unwrapped: its weights are the trained ones (used for sampling)."""
        self.ctx = ctx
        self.config = config
        """The run's config (None when built outside the trainer): strategies read knobs here."""
        self.optimizer = make_optimizer(module.parameters())
        self.comm_seconds = 0.0
        """Communication the last step waited for (not hidden behind compute), in seconds."""

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        """Forward pass."""
        return self.module(*inputs, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward pass; after it every parameter's `.grad` is what the optimizer should use."""
        loss.backward()

    def train_step(self, inputs: Any, targets: Any, loss_fn: LossFn) -> float:
        """Forward and backward of this rank's batch; return its mean loss.

        A dict batch (`inputs` a Mapping; the loop passes the same dict as `targets`) is called
        as `model(**inputs)`, the Hugging Face convention; the loss is `loss_fn(output, targets)`
        either way. (`tessera.strategies`' `train_step(batch)` replaces this signature.)
        """
        output = self(**inputs) if isinstance(inputs, Mapping) else self(inputs)
        loss = loss_fn(output, targets)
        self.backward(loss)
        return loss.item()

    def clip_grad_norm(self, max_norm: float) -> float:
        """Scale gradients so their global norm is at most `max_norm`; return the norm before."""
        return float(nn.utils.clip_grad_norm_(self.module.parameters(), max_norm))

    def step(self, lr: float) -> None:
        """Apply the optimizer with learning rate `lr`, then clear the gradients."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def model_state_bytes(self) -> int | None:
        """Bytes of parameters, gradients and optimizer state this rank holds, if measured."""
        return None

    def full_model_state(self) -> dict[str, torch.Tensor]:
        """The whole model's `state_dict` (plain module keys), complete at least on rank 0."""
        return self.module.state_dict()

    def state_dict(self) -> dict[str, Any]:
        """Full model and optimizer state, complete at least on rank 0."""
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (every rank loads the same full state)."""
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


class TorchDDPEngine(Engine):
    """PyTorch's own DistributedDataParallel: the anchor tessera's strategies are compared with.

    DDP broadcasts rank 0's weights at construction and all-reduces gradient buckets during
    backward. The exposed communication time is measured from outside DDP: a post-accumulate hook
    on every parameter records when the last gradient was produced; what remains of backward after
    that is DDP waiting for its last buckets, i.e. communication that compute did not hide.
    """

    def __init__(
        self,
        module: nn.Module,
        make_optimizer: OptimizerFactory,
        ctx: Context,
        config: TrainConfig | None = None,
    ) -> None:
        super().__init__(module, make_optimizer, ctx, config)
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        self.ddp = nn.parallel.DistributedDataParallel(module, device_ids=device_ids)
        self._last_gradient_at = 0.0
        for parameter in module.parameters():
            if parameter.requires_grad:
                parameter.register_post_accumulate_grad_hook(self._mark_gradient)

    def _mark_gradient(self, _parameter: torch.Tensor) -> None:
        self._last_gradient_at = time.perf_counter()

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        """Forward through DDP, which prepares the gradient reduction of this step."""
        return self.ddp(*inputs, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward; DDP's hooks all-reduce (average) gradients as buckets fill."""
        self._last_gradient_at = time.perf_counter()
        loss.backward()
        self.comm_seconds = max(0.0, time.perf_counter() - self._last_gradient_at)
