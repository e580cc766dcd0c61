"""`strategy="zero1" | "zero2" | "zero3"`: ZeRO over the default group, with offload.

The optimizer factory is called on the model's own parameters, as under every other strategy;
ZeRO reads its `param_groups` and keeps each group's hyper-parameters for that group's shards
(`tessera.zero.groups`). `engine.optimizer` is then the torch optimizer over this rank's master
shards, one group per user group, in order: its `param_groups`' lr is the one the ZeRO step
uses (a scheduler may set each group's), also under the delayed update (the step in flight holds
its own copy).

Checkpoints are sharded: `save(folder)` has every rank write its shard into `folder/zero/`
beside `engine.pt` (rank 0's, which names the shard folder), so a run saved on 4 ranks loads on
2 (resharding on load) and `tessera.zero.consolidate` yields one plain state dict.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tessera.optim.clip import squared_sum
from tessera.runtime.context import Context
from tessera.strategies.capabilities import Capabilities
from tessera.strategies.engine import Engine, OptimizerFactory
from tessera.strategies.registry import declare_strategy
from tessera.zero.api import full_state_dict, shard
from tessera.zero.checkpoint import load_shards, save_shard
from tessera.zero.policy import OffloadPolicy, ZeroPolicy

__all__ = [
    "SHARD_ROOT",
    "OffloadPolicy",
    "Zero1Engine",
    "Zero2Engine",
    "Zero3Engine",
    "ZeroEngine",
    "ZeroPolicy",
    "build_zero1",
    "build_zero2",
    "build_zero3",
]

SHARD_ROOT = "zero"
"""Folder of a saved engine (or trainer checkpoint) holding the rank shards."""


class ZeroEngine(Engine):
    """A ZeRO stage (1, 2 or 3) around the user's model."""

    sharded_checkpoint = True
    items_over_ranks = True  # gradients averaged over ranks: Engine._items_scale

    stage: int | None = None
    """1, 2 or 3: the class of `strategy="zeroN"` sets it (`Zero1Engine`...), or the keyword."""

    def __init__(
        self,
        module: nn.Module,
        optimizer_factory: OptimizerFactory,
        ctx: Context,
        *,
        stage: int | None = None,
        policy: ZeroPolicy | None = None,
        **steps: Any,
    ) -> None:
        """`steps`: `Engine`'s cross-cutting keywords (loss_fn, grad_clip, precision, ...)."""
        policy = policy if policy is not None else ZeroPolicy()
        stage = stage if stage is not None else self.stage
        if stage not in (1, 2, 3):
            raise ValueError(f"a ZeroEngine needs stage 1, 2 or 3, got {stage!r}")
        self.stage = stage
        self._user_dtypes = {key: t.dtype for key, t in module.state_dict().items()}
        """The dtype of each tensor of the user's model: what `full_state_dict` (and so `export`)
        gives back, whatever ZeRO keeps (fp32 masters, of bf16 parameters too)."""
        self.zero = shard(module, optimizer_factory, stage=stage, policy=policy, device=ctx.device)
        """The ZeRO optimizer (`ZeroStage1/2/3`): reduce-scatter, sharded step, all-gather."""
        super().__init__(module, None, ctx, policy=policy, optimizer=self.zero.optimizer, **steps)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward (of the fp16-scaled loss); buckets are reduce-scattered as they fill, the end
        waits for the last."""
        self.scaled(loss).backward()
        self.comm_seconds = self.zero.reducer.exposed_comm_s

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Accumulate full gradients locally (stages 2/3 then hold whole gradient buckets, as
        FSDP's `no_sync` does) until the next synced backward reduce-scatters their sum once."""
        return self.zero.reducer.no_sync()

    def local_gradients(self) -> list[torch.Tensor | None]:
        """This rank's reduced gradient slices: what its sharded step reads."""
        return list(self.zero.gradient_slices())

    def discard_gradients(self) -> None:
        """Forget the reduced slices and the module's gradients (a skipped fp16 step)."""
        self.zero.zero_grad()

    def squared_norm_share(self) -> torch.Tensor:
        """The squared sum of this rank's slices: every element sits in one rank's slice."""
        return squared_sum(self.local_gradients())

    def reduce_squared_norm(self, total: torch.Tensor) -> torch.Tensor:
        """Summed over ZeRO's group on its stream (offloaded: back on the host, where the
        gradients are scaled)."""
        return self.zero.reduce_squared_norm(total)

    def optimizer_step(self) -> None:
        """Step this rank's slices, all-gather (publish) them, clear the gradients."""
        self.zero.step()
        self.zero.zero_grad()

    def _skips_on_device(self) -> bool:
        """fp16 without a host read where the inner optimizer on the masters takes `found_inf`
        (torch's fused Adam(W), SGD): a step it skips leaves the masters as they were, and
        publishing them again gives every rank the parameters it had. Not under offload or the
        delayed update: CPUAdam's step takes no flag, and it runs on the host."""
        return (
            bool(getattr(self.optimizer, "_step_supports_amp_scaling", False))
            and self.zero.link is None
            and self.zero.delayed is None
            and not self.zero.swapped_masters
        )

    def model_state_bytes(self) -> int:
        """Parameters, gradients and optimizer state held by this rank, counted from storages."""
        return self.zero.memory_usage()["total"]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model gathered from the shards, on every rank (collective); under the
        delayed update the masters after every step taken, the one in flight included. Each
        tensor in the user's model's dtype: a bf16 parameter's fp32 master is rounded to bf16 (as
        single-process training keeps it); under `precision="bf16"` the fp32 masters of an fp32
        model stay fp32."""
        state = full_state_dict(self.module)
        return {key: t.to(self._user_dtypes.get(key, t.dtype)) for key, t in state.items()}

    def state_dict(self) -> dict[str, Any]:
        """The full model only (collective): the optimizer state stays in shards (`save`)."""
        return self.precision_state({"model": self.full_state_dict()})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Not possible: a ZeRO engine's optimizer state is sharded; restore with `load`."""
        raise NotImplementedError(
            "a ZeRO engine restores its sharded optimizer state from files: use engine.load(dir)"
        )

    def save_files(self, folder: Path) -> dict[str, Any]:
        """Collective: every rank writes its shard into `folder/zero`; returns what names them."""
        save_shard(Path(folder) / SHARD_ROOT, self.zero)
        names = {"zero_shards": SHARD_ROOT, "world_size": self.zero.world, "stage": self.stage}
        return self.precision_state(names)

    def load_files(self, folder: Path, payload: dict[str, Any]) -> None:
        """Load the shards `payload` names (relative to `folder`), saved on any world size."""
        if "zero_shards" not in payload:
            raise ValueError(f"{folder} holds no ZeRO shards: it was not saved by a ZeRO engine")
        load_shards(self.zero, Path(folder) / payload["zero_shards"])
        self.load_precision_state(payload)

    def close(self) -> None:
        """Finish a delayed step in flight; release an `offload="nvme"` optimizer's files."""
        self.zero.wait_for_step()
        close = getattr(self.zero.optimizer, "close", None)
        if close is not None:
            close()


class Zero1Engine(ZeroEngine):
    """`strategy="zero1"`: optimizer states sharded."""

    stage = 1


class Zero2Engine(ZeroEngine):
    """`strategy="zero2"`: optimizer states and gradients sharded."""

    stage = 2


class Zero3Engine(ZeroEngine):
    """`strategy="zero3"`: optimizer states, gradients and parameters sharded."""

    stage = 3


build_zero1, build_zero2, build_zero3 = Zero1Engine, Zero2Engine, Zero3Engine
"""The registry's former builder names of the three stages."""

_ELASTIC = Capabilities(elastic=True, resume_any_world=True)
for _name, _engine in (("zero1", Zero1Engine), ("zero2", Zero2Engine)):
    # ZeRO's knobs (the offload group folded into `offload`) but ZeRO-3's offload_params
    declare_strategy(
        _name, _engine, policy=ZeroPolicy, capabilities=_ELASTIC, leaving_out=("offload_params",)
    )
declare_strategy(
    "zero3",
    Zero3Engine,
    policy=ZeroPolicy,
    capabilities=Capabilities(
        elastic=True,
        resume_any_world=True,
        builds_on_meta=True,
        not_compilable="its module hooks gather and free each parameter's storage around every "
        "forward",
    ),
)
