"""`initialize` and `full_state_dict`: the public entry points of ZeRO (Rajbhandari et al. 2020).

Stage 0 is tessera's `DataParallel` with a plain optimizer; stages 1-3 are `ZeroStage1/2/3`.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tessera.data_parallel.ddp import DataParallel
from tessera.optim.offload import host_optimizer
from tessera.zero.delayed import DEFAULT_WARMUP_STEPS, check_delayed_update
from tessera.zero.optimizer import ZeroOptimizer
from tessera.zero.stage1 import ZeroStage1
from tessera.zero.stage2 import ZeroStage2
from tessera.zero.stage3 import ZeroStage3
from tessera.zero.units import UnitSpec

__all__ = ["STAGES", "full_state_dict", "initialize"]

STAGES: dict[int, type[ZeroOptimizer]] = {1: ZeroStage1, 2: ZeroStage2, 3: ZeroStage3}


def _check_optimizer(optimizer_class: Any, kwargs: dict[str, Any]) -> None:
    if not (
        isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)
    ):
        raise TypeError(
            f"optimizer_class must be a torch.optim.Optimizer subclass (e.g. torch.optim.AdamW), "
            f"got {optimizer_class!r}"
        )
    parameters = inspect.signature(optimizer_class.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    known = [name for name in parameters if name not in ("self", "params")]
    for key in kwargs:
        if key not in known:
            raise ValueError(
                f"{optimizer_class.__name__} has no option {key!r}; it takes {', '.join(known)}"
            )


def initialize(
    model: nn.Module,
    optimizer_class: type[torch.optim.Optimizer],
    *,
    stage: int,
    group: dist.ProcessGroup | None = None,
    mixed_precision: str | None = None,
    units: Sequence[UnitSpec] | UnitSpec | None = None,
    offload: str | None = None,
    nvme_dir: str | None = None,
    nvme_buffer_mb: float = 64.0,
    offload_params: bool = False,
    delayed_update: bool = False,
    delayed_update_after: int = DEFAULT_WARMUP_STEPS,
    **optimizer_kwargs: Any,
) -> tuple[nn.Module, Any]:
    """Shard `model`'s training state over `group` with ZeRO `stage` (0 = plain DDP).

    Returns `(model, optimizer)`, driven as `optimizer.zero_grad(); loss.backward();
    optimizer.step()`; each rank feeds its own slice of the batch. `mixed_precision="bf16"`
    computes and communicates in bf16 with fp32 master weights and optimizer state (stages 1-3).
    Every rank must build the same model; rank 0's initial weights are used.

    `units` (stage 3) chooses what is gathered as one, like wrapping modules with FSDP2's
    `fully_shard`: module classes and/or dotted name patterns (`"blocks.*"`); by default every
    child of an `nn.ModuleList`/`nn.Sequential` with parameters (`tessera.zero.units`).

    `offload="cpu"` (ZeRO-Offload, stages 1-3) runs the step on the host with
    `tessera.optim.CPUAdam` (`optimizer_class` AdamW, Adam or CPUAdam; `tessera.optim.offload`).
    `offload="nvme"` (ZeRO-Infinity) keeps Adam's moments (and the fp32 masters under
    mixed precision; with `offload_params=True`, stage 3's parameter partitions) in files under
    `nvme_dir`, streamed through `nvme_buffer_mb` MB of buffers (`tessera.optim.nvme.NVMeAdam`),
    in steps and in checkpoints (`tessera.zero.checkpoint`).

    `delayed_update=True` (with `offload="cpu"`) is ZeRO-Offload's one-step delayed parameter
    update: after `delayed_update_after` steps in place, each host step runs in the background
    while the next forward and backward run on the parameters from before it, so the update
    applied at step t uses the gradient of step t-1's parameters (`tessera.zero.delayed`).
    Call `optimizer.finish_step()` before evaluating the module at the end.
    """
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    _check_optimizer(optimizer_class, optimizer_kwargs)
    check_delayed_update(delayed_update, delayed_update_after, offload=offload, stage=stage)
    if mixed_precision not in (None, "bf16"):
        raise ValueError(f"mixed_precision must be None or 'bf16', got {mixed_precision!r}")
    optimizer_class, optimizer_kwargs = host_optimizer(
        offload,
        stage,
        model,
        optimizer_class,
        optimizer_kwargs,
        nvme_dir=nvme_dir,
        nvme_buffer_mb=nvme_buffer_mb,
        offload_params=offload_params,
        mixed_precision=mixed_precision,
    )
    if units is not None and stage != 3:
        raise ValueError(f"units= chooses ZeRO-3's gather units; stage {stage} gathers nothing")
    if stage == 0:
        if mixed_precision is not None:
            raise ValueError("mixed_precision needs stage 1, 2 or 3 (stage 0 is plain DDP)")
        wrapped = DataParallel(model, group=group)
        return wrapped, optimizer_class(model.parameters(), **optimizer_kwargs)
    make_optimizer = partial(optimizer_class, **optimizer_kwargs)
    extra: dict[str, Any] = {"units": units} if units is not None else {}
    if offload_params:
        extra["offload_params"] = True  # host_optimizer allowed it for stage 3 only
    if optimizer_kwargs.get("swap_params"):  # NVMeAdam keeps the masters: made straight there
        extra["swap_masters"] = True
    if delayed_update:
        extra["delayed_update"] = True
        extra["delayed_update_after"] = delayed_update_after
    if offload == "cpu":  # CPUAdam streams the masters and gradient slices: huge pages for them
        extra["host_huge_pages"] = True
    optimizer = STAGES[stage](
        model, make_optimizer, group=group, mixed_precision=mixed_precision, **extra
    )
    model._tessera_zero = optimizer  # full_state_dict(model) finds the shards here
    return model, optimizer


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full, unsharded parameters (fp32 masters) and buffers, keyed like `state_dict()`.

    Collective under ZeRO (every rank must call it); the result is complete on every rank.
    """
    if isinstance(model, DataParallel):
        model = model.module
    zero: ZeroOptimizer | None = getattr(model, "_tessera_zero", None)
    plain = model.state_dict(keep_vars=True)
    if zero is None:
        return {key: tensor.detach().clone() for key, tensor in plain.items()}
    full = zero.full_parameters()
    names = {id(p): name for name, p in model.named_parameters()}
    out = {}
    for key, tensor in plain.items():
        name = names.get(id(tensor))
        out[key] = full[name] if name in full else tensor.detach().clone()
    return out
