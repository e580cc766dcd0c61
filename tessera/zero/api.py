"""`initialize` and `full_state_dict`: the public entry points of ZeRO (Rajbhandari et al. 2020).

Stage 0 is tessera's `DataParallel` with a plain optimizer; stages 1-3 are `ZeroStage1/2/3`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tessera.data_parallel.ddp import DataParallel
from tessera.data_parallel.policy import DDPPolicy
from tessera.optim.cpu_adam import CPUAdam
from tessera.optim.offload import ADAM_OPTIONS, host_optimizer
from tessera.zero.delayed import DEFAULT_WARMUP_STEPS, check_delayed_update
from tessera.zero.groups import OptimizerGroups
from tessera.zero.materialize import InitFn, prepare_meta, refuse_meta
from tessera.zero.optimizer import ZeroOptimizer
from tessera.zero.policy import OffloadPolicy, ZeroPolicy
from tessera.zero.stage1 import ZeroStage1
from tessera.zero.stage2 import ZeroStage2
from tessera.zero.stage3 import ZeroStage3
from tessera.zero.units import UnitSpec

__all__ = ["STAGES", "full_state_dict", "initialize", "shard"]

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
    bucket_cap_mb: float = DDPPolicy.bucket_cap_mb,
    init_fn: InitFn | None = None,
    device: torch.device | str | None = None,
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
    `bucket_cap_mb` (stages 0-2) is the gradient bucket size.

    Stage 3 takes a model built on the meta device (`with torch.device("meta"): model = ...`):
    each rank materialises on `device` (default: the group's, cuda under nccl, else cpu) one unit
    at a time through `init_fn(module)` or each module's `reset_parameters()`, and keeps only its
    shard, so no rank holds the whole model (`tessera.zero.materialize`, which says when the
    values equal the model built whole). The other stages refuse a meta-device model.

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

    The keywords are those of `ZeroPolicy` and `OffloadPolicy`, which `shard` (and with it
    `tessera.setup` and `tessera train`) takes: one translation for every path.

    Why so many parameters: this is the functional front of those two policies, one keyword
    per policy field with the policy's default; code that holds the policies calls `shard`.
    """
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
    _check_optimizer(optimizer_class, optimizer_kwargs)
    check_delayed_update(delayed_update, delayed_update_after, offload=offload, stage=stage)
    if offload not in (None, "cpu", "nvme"):
        raise ValueError(f"offload must be one of (None, 'cpu', 'nvme'), got {offload!r}")
    if offload is None and (nvme_dir is not None or offload_params):
        raise ValueError("nvme_dir and offload_params go with offload='nvme', not offload=None")
    if stage == 0:
        refuse_meta(model, "ZeRO stage 0 (plain DDP)")
        if init_fn is not None:
            raise ValueError("init_fn initialises a meta-device model under ZeRO stage 3 only")
        if mixed_precision is not None:
            raise ValueError("mixed_precision needs stage 1, 2 or 3 (stage 0 is plain DDP)")
        if offload is not None:
            raise ValueError(
                f"offload={offload!r} needs ZeRO stage 1, 2 or 3 (stage 0 is plain DDP)"
            )
        if units is not None:
            raise ValueError("units= chooses ZeRO-3's gather units; stage 0 gathers nothing")
        wrapped = DataParallel(model, group=group, bucket_cap_mb=bucket_cap_mb)
        return wrapped, optimizer_class(model.parameters(), **optimizer_kwargs)
    offload_policy = None
    if offload is not None:
        offload_policy = OffloadPolicy(
            device=offload,
            nvme_dir=nvme_dir,
            nvme_buffer_mb=nvme_buffer_mb,
            params=offload_params,
            delayed_update=delayed_update,
            delayed_update_after=delayed_update_after,
        )
    policy = ZeroPolicy(
        bucket_cap_mb=bucket_cap_mb,
        mixed_precision=mixed_precision,
        units=units,
        offload=offload_policy,
        init_fn=init_fn,
    )
    make_optimizer = partial(optimizer_class, **optimizer_kwargs)
    return model, shard(
        model, make_optimizer, stage=stage, policy=policy, group=group, device=device
    )


def shard(
    model: nn.Module,
    make_optimizer: Callable[[Any], torch.optim.Optimizer],
    *,
    stage: int,
    policy: ZeroPolicy | None = None,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
) -> ZeroOptimizer:
    """Shard `model` with ZeRO `stage` (1-3) as `policy` says; return the ZeRO optimizer.

    Stage 3 materialises a meta-device `model` on `device` (default: the group's), one unit at a
    time (`tessera.zero.materialize`); stages 1 and 2 refuse one.

    `make_optimizer(params)` builds the user's optimizer; it is called once on the model's own
    parameters, and its groups are kept: each bucket holds one group's parameters and its
    master shard steps with that group's hyper-parameters (`tessera.zero.groups`). Under
    `policy.offload` its class and each group's hyper-parameters become `CPUAdam` / `NVMeAdam`
    with the same values (`tessera.optim.offload.host_optimizer`); `offload.device="cpu"` also
    puts the buffers the host step streams on huge pages. Collective over `group`.
    """
    if isinstance(stage, bool) or stage not in (1, 2, 3):
        raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage!r}")
    policy = policy if policy is not None else ZeroPolicy()
    if policy.units is not None and stage != 3:
        raise ValueError(f"units= chooses ZeRO-3's gather units; stage {stage} gathers nothing")
    extra: dict[str, Any] = {}
    if stage == 3:
        pending = prepare_meta(model, device or _group_device(group), policy.init_fn)
        if pending is not None:
            extra["meta_init"] = pending
    else:
        refuse_meta(model, f"ZeRO stage {stage}")
        if policy.init_fn is not None:
            raise ValueError("init_fn initialises a meta-device model under ZeRO stage 3 only")
    if stage < 3:
        extra["bucket_cap_mb"] = policy.bucket_cap_mb
    if policy.units is not None:
        extra["units"] = policy.units
    offload = policy.offload
    groups = OptimizerGroups(model, make_optimizer)  # on the model's own parameters
    if offload is not None:
        assert isinstance(offload, OffloadPolicy)  # ZeroPolicy turned a device name into one
        after = offload.delayed_update_after
        check_delayed_update(offload.delayed_update, after, offload=offload.device, stage=stage)
        precision = policy.mixed_precision
        groups.host = _host_spec(stage, model, groups.user, precision, offload)
        if offload.params:
            extra["offload_params"] = True  # host_optimizer allowed it for stage 3 only
        if groups.host[1].get("swap_params"):  # NVMeAdam keeps the masters
            extra["swap_masters"] = True
        if offload.delayed_update:
            extra["delayed_update"] = True
            extra["delayed_update_after"] = offload.delayed_update_after
        if offload.device == "cpu":  # CPUAdam streams the masters and gradient slices
            extra["host_huge_pages"] = True
        extra["host_step"] = True  # the step on the host, apart from the device's tensors
    optimizer = STAGES[stage](
        model, groups, group=group, mixed_precision=policy.mixed_precision, **extra
    )
    model._tessera_zero = optimizer  # full_state_dict(model) finds the shards here
    return optimizer


def _group_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a meta-device model is materialised by default: the current GPU under nccl."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _host_spec(
    stage: int,
    model: nn.Module,
    user: torch.optim.Optimizer,
    mixed_precision: str | None,
    offload: OffloadPolicy,
) -> tuple[type, dict[str, Any], tuple[str, ...]]:
    """The user's optimizer as `CPUAdam` / `NVMeAdam`: (class, kwargs, per-group keys).

    The user's optimizer (built on the model's parameters) is read, not copied: its class and
    defaults give the host optimizer's options; each of its groups keeps its own values of the
    keys returned (Adam's four; every option of a `CPUAdam`). Options other than Adam's four
    pass only where set to a non-default value in some group (`amsgrad=True`, say), and are
    then refused by `host_optimizer`.
    """
    if type(user) is CPUAdam:
        options = dict(user.defaults)
        keys = tuple(user.defaults)
    else:
        options = {k: user.defaults[k] for k in ADAM_OPTIONS if k in user.defaults}
        flags = ("amsgrad", "maximize")
        options.update({k: True for k in flags for g in user.param_groups if g.get(k)})
        keys = ADAM_OPTIONS
    optimizer_class, kwargs = host_optimizer(
        offload.device,
        stage,
        model,
        type(user),
        options,
        nvme_dir=offload.nvme_dir,
        nvme_buffer_mb=offload.nvme_buffer_mb,
        offload_params=offload.params,
        mixed_precision=mixed_precision,
    )
    if offload.device == "cpu":  # how CPUAdam stores the moments
        kwargs = {**kwargs, **offload.optimizer_options()}
    if optimizer_class is not CPUAdam or type(user) is not CPUAdam:
        keys = tuple(k for k in keys if k in ADAM_OPTIONS)
    return optimizer_class, kwargs, keys


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
