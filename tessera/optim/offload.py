"""Which optimizer ZeRO-Offload runs: the user's Adam(W) choice turned into `CPUAdam`/`NVMeAdam`.

ZeRO-Offload (Ren et al., USENIX ATC 2021) keeps the fp32 master weights, the gradient partition
and Adam's moments in host memory and runs the step there, so the step must be a fast CPU Adam.
`tessera.zero.initialize(..., offload="cpu")` keeps the familiar `optimizer_class=AdamW` (or
`Adam`, or `CPUAdam` itself) and this module maps it, with its options, to `CPUAdam`.

`offload="nvme"` (ZeRO-Infinity, Rajbhandari et al., SC 2021) maps it to `NVMeAdam`, the same
step with the moments in files under `nvme_dir` streamed through `nvme_buffer_mb` of buffers.
The fp32 master weights are files too where they are a copy (`mixed_precision="bf16"`), and with
`offload_params=True` (stage 3 only) ZeRO-3's parameter partition itself: gathers read it back.
With `offload="cpu"`, `offload_params=True` keeps that partition in host memory instead.

ZeRO-Offload's one-step delayed parameter update (`initialize(..., offload="cpu",
delayed_update=True)`, the paper's section 5: the host step overlapped with the next forward and
backward) lives with the ZeRO engine, in `tessera.zero.delayed`.

The model may be on any device: the ZeRO engine moves each bucket's gradient partition to the
host and the updated parameters back (`tessera.zero.host_link`: pinned buffers and a side stream
on CUDA, the same copies between host tensors on the CPU).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tessera.optim.cpu_adam import CPUAdam
from tessera.optim.nvme import NVMeAdam
from tessera.optim.swap_files import check_swap_dir

__all__ = ["ADAM_OPTIONS", "OFFLOAD_MODES", "host_optimizer"]

OFFLOAD_MODES = (None, "cpu", "nvme")
ADAM_OPTIONS = ("lr", "betas", "eps", "weight_decay")
"""The hyper-parameters an Adam(W) hands on to `CPUAdam` / `NVMeAdam`."""
_HARMLESS = ("foreach", "fused", "capturable", "differentiable")  # torch kernel choices only


def host_optimizer(
    offload: str | None,
    stage: int,
    model: nn.Module,
    optimizer_class: type[torch.optim.Optimizer],
    optimizer_kwargs: dict[str, Any],
    *,
    nvme_dir: str | None = None,
    nvme_buffer_mb: float = 64.0,
    offload_params: bool = False,
    mixed_precision: str | None = None,
) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """`(optimizer_class, kwargs)` to build the inner optimizer with under `offload`.

    `offload=None` returns them unchanged. `"cpu"`: `CPUAdam` with the same hyper-parameters
    (AdamW -> decoupled decay, Adam -> L2 decay with Adam's default weight_decay of 0).
    `"nvme"`: `NVMeAdam` with them, its files under `nvme_dir` (checked here: it must exist and
    be writable; the space for the states is checked when the optimizer knows its shard).
    """
    if offload not in OFFLOAD_MODES:
        raise ValueError(f"offload must be one of {OFFLOAD_MODES}, got {offload!r}")
    if offload != "nvme" and nvme_dir is not None:
        raise ValueError(f"nvme_dir goes with offload='nvme', not offload={offload!r}")
    if offload is None and offload_params:
        raise ValueError("offload_params goes with offload='cpu' or 'nvme', not offload=None")
    if offload is None:
        return optimizer_class, optimizer_kwargs
    if stage == 0:
        raise ValueError(f"offload={offload!r} needs ZeRO stage 1, 2 or 3 (stage 0 is plain DDP)")
    if offload_params and stage != 3:
        raise ValueError(
            f"offload_params=True offloads ZeRO-3's parameter partitions; stage {stage} keeps "
            "whole parameters on every rank (use stage=3)"
        )
    if offload == "nvme":
        check_swap_dir(nvme_dir)
        if optimizer_class is CPUAdam and (
            optimizer_kwargs.get("bf16_moments")
            or optimizer_kwargs.get("moments_rounding", "nearest") != "nearest"
        ):
            raise ValueError(
                "offload='nvme' keeps fp32 moments: bf16_moments and moments_rounding are not "
                "supported"
            )
    cpu_class, cpu_kwargs = _as_cpu_adam(offload, optimizer_class, optimizer_kwargs)
    if offload == "cpu":
        return cpu_class, cpu_kwargs
    swap_params = offload_params or mixed_precision is not None  # the fp32 master is a copy
    for bf16_option in ("bf16_moments", "moments_rounding", "rounding_seed"):
        cpu_kwargs.pop(bf16_option, None)
    return NVMeAdam, {
        **cpu_kwargs,
        "nvme_dir": str(nvme_dir),
        "buffer_mb": nvme_buffer_mb,
        "swap_params": swap_params,
    }


def _as_cpu_adam(
    offload: str, optimizer_class: type[torch.optim.Optimizer], optimizer_kwargs: dict[str, Any]
) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """`CPUAdam` and its kwargs for the user's Adam(W) choice; a clear error for another one."""
    adamw = {torch.optim.AdamW: True, torch.optim.Adam: False}.get(optimizer_class)
    if optimizer_class is CPUAdam:
        return CPUAdam, dict(optimizer_kwargs)
    if adamw is None:
        raise ValueError(
            f"offload={offload!r} runs the step with tessera.optim.CPUAdam: use optimizer_class="
            f"torch.optim.AdamW, torch.optim.Adam or CPUAdam, not {optimizer_class.__name__}"
        )
    unsupported = set(optimizer_kwargs) - set(ADAM_OPTIONS) - set(_HARMLESS)
    if optimizer_kwargs.get("amsgrad") or optimizer_kwargs.get("maximize"):
        unsupported |= {k for k in ("amsgrad", "maximize") if optimizer_kwargs.get(k)}
    else:
        unsupported -= {"amsgrad", "maximize"}
    if unsupported:
        raise ValueError(f"offload={offload!r} (CPUAdam) does not support {sorted(unsupported)}")
    kwargs = {k: v for k, v in optimizer_kwargs.items() if k in ADAM_OPTIONS}
    kwargs.setdefault("weight_decay", 1e-2 if adamw else 0.0)  # torch's defaults
    return CPUAdam, {**kwargs, "adamw": adamw}
