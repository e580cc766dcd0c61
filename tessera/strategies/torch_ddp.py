"""`strategy="torch-ddp"`: PyTorch's own DistributedDataParallel, the anchor of tessera's DDP.

DDP broadcasts rank 0's weights at construction and all-reduces gradient buckets during
backward. The exposed communication time is measured from outside DDP: a post-accumulate hook
on every parameter records when the last gradient was produced; what remains of backward after
that is DDP waiting for its last buckets, i.e. communication that compute did not hide.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tessera.data_parallel.policy import TorchDDPPolicy
from tessera.runtime.context import Context
from tessera.strategies.capabilities import Capabilities
from tessera.strategies.engine import Engine, OptimizerFactory
from tessera.strategies.registry import declare_strategy

__all__ = ["TorchDDPEngine", "TorchDDPPolicy", "build"]


class TorchDDPEngine(Engine):
    """`torch.nn.parallel.DistributedDataParallel` around the user's model."""

    items_over_ranks = True  # gradients averaged over ranks: Engine._items_scale

    def __init__(
        self,
        module: nn.Module,
        optimizer_factory: OptimizerFactory,
        ctx: Context,
        *,
        policy: TorchDDPPolicy | None = None,
        **steps: Any,
    ) -> None:
        """`steps`: `Engine`'s cross-cutting keywords (loss_fn, grad_clip, precision, ...)."""
        policy = policy if policy is not None else TorchDDPPolicy()
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        self.ddp = nn.parallel.DistributedDataParallel(
            module, device_ids=device_ids, find_unused_parameters=policy.find_unused_parameters
        )
        self._last_gradient_at = 0.0
        for parameter in module.parameters():
            if parameter.requires_grad:
                parameter.register_post_accumulate_grad_hook(self._mark_gradient)
        super().__init__(module, optimizer_factory, ctx, policy=policy, **steps)

    def reduce_gradients_in(self, dtype: torch.dtype) -> None:
        """Register a comm hook, so DDP all-reduces each bucket in `dtype` (before the first
        backward: DDP's rule). The hook is our own `_compress_hook`, the shape of torch's
        `fp16_compress_hook` for either dtype (torch's own bf16 hook refuses gloo)."""
        self.ddp.register_comm_hook(None, _compress_hook(dtype))

    def _mark_gradient(self, _parameter: torch.Tensor) -> None:
        self._last_gradient_at = time.perf_counter()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Forward through DDP, which prepares the gradient reduction of this step."""
        return self.ddp(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward (of the fp16-scaled loss); DDP's hooks all-reduce (average) gradients as
        buckets fill."""
        self._last_gradient_at = time.perf_counter()
        self.scaled(loss).backward()
        self.comm_seconds = max(0.0, time.perf_counter() - self._last_gradient_at)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """`DistributedDataParallel.no_sync`: gradients accumulate locally until the next
        synced backward, which all-reduces their sum once."""
        return self.ddp.no_sync()


def _compress_hook(dtype: torch.dtype) -> Any:
    """A DDP comm hook: divide by the world size, all-reduce in `dtype`, copy back."""

    def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        low = buffer.to(dtype).div_(dist.get_world_size())
        future = dist.all_reduce(low, async_op=True).get_future()

        def write_back(done: torch.futures.Future) -> torch.Tensor:
            buffer.copy_(done.value()[0])
            return buffer

        return future.then(write_back)

    # DDP checks the annotations as objects; this module's are strings (postponed evaluation)
    hook.__annotations__ = {
        "state": object,
        "bucket": dist.GradBucket,
        "return": torch.futures.Future[torch.Tensor],
    }
    return hook


build = TorchDDPEngine
"""The `torch-ddp` strategy's builder (the registry's name for the engine class)."""

declare_strategy(
    "torch-ddp",
    TorchDDPEngine,
    policy=TorchDDPPolicy,
    capabilities=Capabilities(elastic=True, resume_any_world=True),
)
