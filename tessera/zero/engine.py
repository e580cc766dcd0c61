"""The trainer's ZeRO strategies: `tessera train --strategy zero1|zero2|zero3`.

Each wraps the trainer's GPT with `ZeroStage1/2/3` (`tessera.zero`); the trainer's optimizer
factory is called on this rank's master shards only. Checkpoints are sharded: every rank writes
its own files into `zero/` of the step's checkpoint folder, beside `state.pt` (which rank 0
writes and which names the shard folder; see `tessera.train.checkpoint_series`), so a run saved
on 4 ranks can resume on 2 (resharding on load) and `tessera checkpoint consolidate RUN_DIR
out.safetensors` yields one plain state dict.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tessera.optim.offload import host_optimizer
from tessera.runtime.context import Context
from tessera.train.config import OFFLOAD_MOMENTS
from tessera.train.strategy import Engine, OptimizerFactory
from tessera.zero.api import STAGES, full_state_dict
from tessera.zero.checkpoint import load_shards, save_shard

__all__ = ["Zero1Engine", "Zero2Engine", "Zero3Engine", "ZeroEngine"]

SHARD_ROOT = "zero"
"""Folder of a checkpoint holding its rank shards, beside its state file."""


class ZeroEngine(Engine):
    """A ZeRO stage driven by the training loop (subclasses fix the stage)."""

    stage = 1
    sharded_checkpoint = True
    """The loop calls `save_shards` / `load_shards` on every rank instead of `state_dict`."""

    def __init__(
        self,
        module: nn.Module,
        make_optimizer: OptimizerFactory,
        ctx: Context,
        config: Any = None,
    ) -> None:
        # Not Engine.__init__: it would build an optimizer over the whole model.
        self.module = module
        self.ctx = ctx
        self.config = config
        self.comm_seconds = 0.0
        kwargs: dict[str, Any] = {}
        if config is not None:
            kwargs["mixed_precision"] = config.mixed_precision
            if self.stage < 3:
                kwargs["bucket_cap_mb"] = config.bucket_cap_mb
            if getattr(config, "offload", None):
                make_optimizer = _offload_optimizer(self.stage, module, make_optimizer, config)
                if make_optimizer.keywords.get("swap_params"):
                    kwargs["swap_masters"] = True
            if getattr(config, "offload_params", False):
                kwargs["offload_params"] = True
            if getattr(config, "delayed_update", False):  # ZeRO-Offload's DPU
                kwargs["delayed_update"] = True
                kwargs["delayed_update_after"] = config.delayed_update_after
        self.optimizer = STAGES[self.stage](module, make_optimizer, **kwargs)
        module._tessera_zero = self.optimizer

    def close(self) -> None:
        """Release what outlives training: an `offload="nvme"` optimizer's swap files."""
        self.optimizer.wait_for_step()  # under DPU no step may outlive the engine
        close = getattr(self.optimizer.optimizer, "close", None)
        if close is not None:
            close()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward; buckets are reduce-scattered as they fill, the end waits for the last."""
        loss.backward()
        self.comm_seconds = self.optimizer.reducer.exposed_comm_s

    def full_model_state(self) -> dict[str, torch.Tensor]:
        """The whole model, gathered from the shards (collective); under DPU the masters after
        every step taken, the one in flight included."""
        return full_state_dict(self.module)

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip by the global norm, summed over every rank's gradient shard."""
        return self.optimizer.clip_grad_norm(max_norm)

    def model_state_bytes(self) -> int:
        """Parameters, gradients and optimizer state held by this rank, counted from storages."""
        return self.optimizer.memory_usage()["total"]

    def state_dict(self) -> dict[str, Any]:
        """The full model only (collective); checkpoints go through `save_shards`."""
        return {"model": full_state_dict(self.module)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Not supported: a ZeRO engine resumes from its shards (`load_shards`)."""
        raise NotImplementedError("a ZeRO engine loads sharded checkpoints: use load_shards")

    def save_shards(self, checkpoint: Path, step: int) -> dict[str, Any]:
        """Collective: each rank writes its shard beside the state file `checkpoint` (in the
        checkpoint's folder, `zero/`); returns what the state file should hold."""
        save_shard(checkpoint.parent / SHARD_ROOT, self.optimizer, step=step)
        if self.ctx.world_size > 1:
            dist.barrier()
        return {"zero_shards": SHARD_ROOT, "world_size": self.optimizer.world, "stage": self.stage}

    def load_shards(self, checkpoint: Path, meta: dict[str, Any]) -> None:
        """Load the shards the state file `checkpoint` names, from any world size.

        `zero_shards` is relative to the state file's folder (`zero` in a checkpoint folder;
        `zero/step-N` beside the `checkpoint.pt` of older run folders).
        """
        load_shards(self.optimizer, checkpoint.parent / meta["zero_shards"])


def _offload_optimizer(
    stage: int, module: nn.Module, make_optimizer: OptimizerFactory, config: Any
) -> OptimizerFactory:
    """The trainer's optimizer as `CPUAdam` / `NVMeAdam` with the same hyper-parameters.

    The factory is asked once, on a one-element probe, which class and options it uses, so the
    trainer's choice (`train.loop.make_optimizer`) is read, not copied here.
    """
    probe = make_optimizer([nn.Parameter(torch.zeros(1))])
    options = {k: probe.defaults[k] for k in ("lr", "betas", "eps", "weight_decay")}
    optimizer_class, kwargs = host_optimizer(
        config.offload,
        stage,
        module,
        type(probe),
        options,
        nvme_dir=config.nvme_dir,
        nvme_buffer_mb=config.nvme_buffer_mb,
        offload_params=config.offload_params,
        mixed_precision=config.mixed_precision,
    )
    # --offload-moments (offload cpu only, the config checks): how CPUAdam stores the moments
    kwargs.update(OFFLOAD_MOMENTS[getattr(config, "offload_moments", "fp32")])
    return partial(optimizer_class, **kwargs)


class Zero1Engine(ZeroEngine):
    """ZeRO stage 1: optimizer states sharded (communication as DDP)."""

    stage = 1


class Zero2Engine(ZeroEngine):
    """ZeRO stage 2: optimizer states and gradients sharded (communication as DDP)."""

    stage = 2


class Zero3Engine(ZeroEngine):
    """ZeRO stage 3: parameters sharded too, gathered per block (1.5x DDP's communication)."""

    stage = 3
