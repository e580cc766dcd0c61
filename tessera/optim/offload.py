"""Which optimizer ZeRO-Offload runs: the user's Adam(W) choice turned into `CPUAdam`.

ZeRO-Offload (Ren et al., USENIX ATC 2021) keeps the fp32 master weights, the gradient partition
and Adam's moments in host memory and runs the step there, so the step must be a fast CPU Adam.
`tessera.zero.initialize(..., offload="cpu")` keeps the familiar `optimizer_class=AdamW` (or
`Adam`, or `CPUAdam` itself) and this module maps it, with its options, to `CPUAdam`.

What is not done yet (issue 12): on CUDA, streaming gradients to pinned host buffers and the
updated parameters back, overlapped with backward/forward, and `offload="nvme"`. Both are refused
with a clear error instead of silently running something else.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tessera.optim.cpu_adam import CPUAdam

__all__ = ["OFFLOAD_MODES", "host_optimizer"]

OFFLOAD_MODES = (None, "cpu")
_ADAM_OPTIONS = ("lr", "betas", "eps", "weight_decay")
_HARMLESS = ("foreach", "fused", "capturable", "differentiable")  # torch kernel choices only


def host_optimizer(
    offload: str | None,
    stage: int,
    model: nn.Module,
    optimizer_class: type[torch.optim.Optimizer],
    optimizer_kwargs: dict[str, Any],
) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """`(optimizer_class, kwargs)` to build the inner optimizer with under `offload`.

    `offload=None` returns them unchanged. `"cpu"`: `CPUAdam` with the same hyper-parameters
    (AdamW -> decoupled decay, Adam -> L2 decay with Adam's default weight_decay of 0).
    """
    if offload not in OFFLOAD_MODES:
        if offload == "nvme":
            raise NotImplementedError("offload='nvme' (ZeRO-Infinity) is not implemented yet")
        raise ValueError(f"offload must be one of {OFFLOAD_MODES}, got {offload!r}")
    if offload is None:
        return optimizer_class, optimizer_kwargs
    if stage == 0:
        raise ValueError("offload='cpu' needs ZeRO stage 1, 2 or 3 (stage 0 is plain DDP)")
    devices = {p.device.type for p in model.parameters()}
    if devices - {"cpu"}:
        raise NotImplementedError(
            f"offload='cpu' with parameters on {sorted(devices - {'cpu'})}: streaming between "
            "device and host is not implemented yet; the CPU-only path is"
        )
    adamw = {torch.optim.AdamW: True, torch.optim.Adam: False}.get(optimizer_class)
    if optimizer_class is CPUAdam:
        return CPUAdam, dict(optimizer_kwargs)
    if adamw is None:
        raise ValueError(
            "offload='cpu' runs the step with tessera.optim.CPUAdam: use optimizer_class="
            f"torch.optim.AdamW, torch.optim.Adam or CPUAdam, not {optimizer_class.__name__}"
        )
    unsupported = set(optimizer_kwargs) - set(_ADAM_OPTIONS) - set(_HARMLESS)
    if optimizer_kwargs.get("amsgrad") or optimizer_kwargs.get("maximize"):
        unsupported |= {k for k in ("amsgrad", "maximize") if optimizer_kwargs.get(k)}
    else:
        unsupported -= {"amsgrad", "maximize"}
    if unsupported:
        raise ValueError(f"offload='cpu' (CPUAdam) does not support {sorted(unsupported)}")
    kwargs = {k: v for k, v in optimizer_kwargs.items() if k in _ADAM_OPTIONS}
    kwargs.setdefault("weight_decay", 1e-2 if adamw else 0.0)  # torch's defaults
    return CPUAdam, {**kwargs, "adamw": adamw}
