"""Mixed precision for every strategy: `tessera.setup(..., precision="fp32" | "bf16" | "fp16")`.

What each precision means, whatever the strategy:
- Compute under `torch.autocast` on the engine's device type with the low dtype: matrix
  products and convolutions run in bf16/fp16, reductions such as the loss stay fp32.
- The parameters the optimizer steps (the master weights) and its state stay fp32.
- Gradients are communicated in the low dtype where the strategy communicates them: ddp casts
  each bucket for its all-reduce (`tessera.data_parallel.compression.cast_hook`), torch-ddp
  registers a comm hook that all-reduces each bucket in the low dtype (torch's own bf16 hook
  refuses gloo), zero1-3 in bf16 keep bf16 weights and gradients
  (ZeRO's own `mixed_precision="bf16"`: the reduce-scatter and all-gather move bf16), a pipeline
  sends its activations and their gradients between stages in the dtype autocast produced, and
  hybrid averages a stage's gradients over its dp group in the low dtype (tessera's DDP buckets).
  Where they are not: zero1-3 in fp16 and hybrid's ZeRO inside stages (`zero=1|2`) reduce fp32
  gradients (the weights stay fp32 under autocast there; casting inside ZeRO's reduce-scatter is
  not done); local-sgd averages fp32 parameters (it communicates no gradients); tensor
  parallelism's all-reduces carry whatever dtype autocast produced.
- fp16 adds dynamic loss scaling (`tessera.optim.loss_scale.DynamicLossScaler`): `backward`
  scales the loss, `step` unscales the gradients, checks them for inf/nan over every rank, and
  skips the step (halving the scale) when any rank found one; clipping sees unscaled gradients.
  Where the optimizer's step takes `found_inf` (torch's fused Adam/AdamW/SGD) and the strategy's
  step is that step alone (or, under ZeRO without offload, that step on the masters and a
  publish), the skip and the scale stay on the device, as `torch.amp.GradScaler` does: no host
  read a step (`Engine._skips_on_device`); elsewhere the flag is read once a step.

ZeRO keeps its own bf16 path (bf16 parameter buffers, fp32 master shards, and its forward under
autocast for what is not sharded: frozen layers, keyword inputs, `tessera.zero.bf16_forward`):
`precision="bf16"` under zero1-3 sets the policy's `mixed_precision="bf16"` rather than the
engine's autocast, so `tessera.setup(..., precision="bf16")`, `mixed_precision="bf16"` and the
trainer's `--mixed-precision bf16` are one and the same run.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from tessera.optim.loss_scale import DynamicLossScaler
from tessera.runtime.devices import collective_device

__all__ = [
    "DTYPES",
    "PRECISIONS",
    "autocast_context",
    "check_precision",
    "route_to_policy",
    "sum_flag",
]

PRECISIONS = ("fp32", "bf16", "fp16")
"""The values of `precision=` (and of `tessera train --mixed-precision`, fp32 being unset)."""

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""The compute dtype of each low precision."""


def check_precision(precision: Any, loss_scaler: Any) -> None:
    """Refuse an unknown precision, or a loss scaler without fp16 (one clear error)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if loss_scaler is not None and not isinstance(loss_scaler, DynamicLossScaler):
        raise TypeError(
            f"loss_scaler must be a tessera.optim.DynamicLossScaler, got "
            f"{type(loss_scaler).__name__}"
        )
    if loss_scaler is not None and precision != "fp16":
        raise ValueError(f"loss_scaler goes with precision='fp16' (got precision={precision!r})")


def route_to_policy(policy: Any, precision: str) -> tuple[Any, str]:
    """A policy with its own `mixed_precision` (ZeRO's) takes bf16 itself.

    Returns the policy to build with and the engine's precision. A policy already set to bf16
    makes the engine bf16; a policy set to bf16 with another `precision` is refused.
    """
    fields = {field.name for field in dataclasses.fields(policy)}
    if "mixed_precision" not in fields:
        return policy, precision
    own = policy.mixed_precision
    if own is not None and precision not in ("fp32", own):
        raise ValueError(
            f"mixed_precision={own!r} and precision={precision!r} disagree: give precision only"
        )
    if own is None and precision == "bf16":
        return dataclasses.replace(policy, mixed_precision="bf16"), "bf16"
    return policy, own or precision


def autocast_context(
    device: torch.device, dtype: torch.dtype | None
) -> contextlib.AbstractContextManager:
    """`torch.autocast` on `device`'s type with `dtype`, or nothing when `dtype` is None."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def sum_flag(flag: torch.Tensor) -> torch.Tensor:
    """Sum `flag` over the world group, on its communication stream (in order with every
    engine's collectives, `tessera.comm.stream`); unchanged without a process group."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    from tessera.comm.stream import stream_for

    device = collective_device()  # asked here: a thread's current CUDA device is its own

    def reduce(tensor: torch.Tensor) -> torch.Tensor:
        on_device = tensor.to(device)  # NCCL reduces device tensors only
        dist.all_reduce(on_device)
        return on_device.to(tensor.device)

    return stream_for(None).run(reduce, flag, what="fp16 overflow check")
