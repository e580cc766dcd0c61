"""The knobs of ZeRO, one default and one translation each: `ZeroPolicy` and `OffloadPolicy`.

`tessera.zero.initialize`, `tessera.setup(strategy="zero1|2|3")` and `tessera train` all build
these and hand them to `tessera.zero.api.shard`, so a knob means the same on every path (the
huge pages of `offload="cpu"`, for one, were once set by `initialize` and not by the trainer).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tessera.data_parallel.policy import DDPPolicy, check_bucket_cap_mb, check_flag
from tessera.zero.delayed import DEFAULT_WARMUP_STEPS, check_delayed_update

__all__ = ["MOMENT_STORAGE", "OffloadPolicy", "ZeroPolicy"]

MOMENT_STORAGE: dict[str, dict[str, Any]] = {
    "fp32": {},
    "bf16": {"bf16_moments": True},
    "bf16-stochastic": {"bf16_moments": True, "moments_rounding": "stochastic"},
}
"""`OffloadPolicy.moments` -> the `CPUAdam` options it stands for."""


@dataclass(kw_only=True, frozen=True)
class OffloadPolicy:
    """Where ZeRO's sharded optimizer step runs and its state lives (ZeRO-Offload / -Infinity).

    `device="cpu"`: the step runs on the host with `tessera.optim.CPUAdam`, its buffers on
    transparent huge pages. `device="nvme"`: Adam's moments (and, under mixed precision or with
    `params=True`, the masters / ZeRO-3's parameter partitions) in files under `nvme_dir`.
    """

    device: str = "cpu"
    """`cpu` (ZeRO-Offload) or `nvme` (ZeRO-Infinity)."""
    nvme_dir: str | None = field(
        default=None,
        metadata={"help": "offload nvme: existing writable folder for the files."},
    )
    """`nvme`: an existing writable folder for the state files."""
    nvme_buffer_mb: float = field(
        default=64.0,
        metadata={"help": "offload nvme: memory of the streaming buffers, MB."},
    )
    """`nvme`: memory of the streaming buffers, in MB."""
    params: bool = field(
        default=False,
        metadata={
            "knob": "offload_params",
            "help": "zero3 with offload: the parameter partitions go to the host (cpu) or "
            "nvme_dir.",
        },
    )
    """Stage 3: ZeRO-3's parameter partitions leave the device too (`cpu`: host memory, `nvme`:
    files), each gather copying them up ahead of use."""
    moments: str = field(
        default="fp32",
        metadata={
            "knob": "offload_moments",
            "help": "offload cpu: how CPUAdam stores Adam's two moments: fp32, bf16 (round to "
            "nearest: fewer bytes per step, an accuracy cost) or bf16-stochastic (stochastic "
            "rounding, unbiased).",
        },
    )
    """`cpu`: how CPUAdam stores Adam's moments: fp32, bf16 or bf16-stochastic."""
    delayed_update: bool = field(
        default=False,
        metadata={
            "help": "offload cpu: one-step delayed parameter update (ZeRO-Offload's DPU): each "
            "host step runs beside the next forward/backward, which use the parameters of one "
            "step before."
        },
    )
    """`cpu`: one-step delayed parameter update (DPU), the host step beside the next backward."""
    delayed_update_after: int = field(
        default=DEFAULT_WARMUP_STEPS,
        metadata={
            "help": "delayed_update: steps run without delay first (the paper's 'few dozen')."
        },
    )
    """`delayed_update`: steps run in place before the delay starts."""

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "nvme"):
            raise ValueError(f"offload device must be 'cpu' or 'nvme', got {self.device!r}")
        if self.device != "nvme" and self.nvme_dir is not None:
            raise ValueError(f"nvme_dir goes with offload='nvme', not offload={self.device!r}")
        if not self.nvme_buffer_mb > 0:
            raise ValueError(f"nvme_buffer_mb must be positive, got {self.nvme_buffer_mb!r}")
        if self.moments not in MOMENT_STORAGE:
            raise ValueError(
                f"moments must be one of {', '.join(MOMENT_STORAGE)}, got {self.moments!r}"
            )
        if self.moments != "fp32" and self.device != "cpu":
            raise ValueError(
                f"moments={self.moments} is CPUAdam's storage: it needs offload device cpu"
            )
        check_flag("params", self.params)
        check_delayed_update(self.delayed_update, self.delayed_update_after, offload=self.device)

    def optimizer_options(self) -> dict[str, Any]:
        """Extra options of the host optimizer this policy asks for (`CPUAdam`'s moments)."""
        return dict(MOMENT_STORAGE[self.moments])


@dataclass(kw_only=True, frozen=True)
class ZeroPolicy:
    """ZeRO's own knobs (the stage is the strategy's name: zero1, zero2, zero3).

    `offload` takes an `OffloadPolicy`, or a device name as shorthand (`offload="cpu"` is
    `OffloadPolicy(device="cpu")`).
    """

    bucket_cap_mb: float = field(
        default=DDPPolicy.bucket_cap_mb, metadata={"same_as": (DDPPolicy, "bucket_cap_mb")}
    )
    """Stages 1-2: gradient bucket size in MB (stage 3 reduces per gather unit); DDP's knob, as
    stages 1-2 reduce through DDP's buckets: its default and its check."""
    mixed_precision: str | None = None
    """`bf16`: compute and communicate in bf16, fp32 master weights and optimizer state."""
    units: Sequence[Any] | Any | None = None
    """Stage 3: module classes and/or name patterns gathered as one (default: every block)."""
    offload: OffloadPolicy | str | None = field(
        default=None,
        metadata={
            "help": "zero1-3 with adamw: cpu (ZeRO-Offload: the step runs on the host with "
            "CPUAdam) or nvme (ZeRO-Infinity: optimizer state in files under nvme_dir, streamed "
            "through buffers).",
            "config_type": str | None,
            "folds": OffloadPolicy,
        },
    )
    """Offload of the optimizer step and state, or None."""
    init_fn: Callable[[Any], None] | None = None
    """Stage 3, a model built on the meta device: `init_fn(module)` initialises each module's own
    tensors (default: the module's `reset_parameters()`); see `tessera.zero.materialize`."""

    def __post_init__(self) -> None:
        check_bucket_cap_mb(self.bucket_cap_mb)
        if self.mixed_precision not in (None, "bf16"):
            raise ValueError(
                f"mixed_precision must be None or 'bf16', got {self.mixed_precision!r}"
            )
        if self.init_fn is not None and not callable(self.init_fn):
            raise ValueError(f"init_fn must be a function of one module, got {self.init_fn!r}")
        if isinstance(self.offload, str):
            object.__setattr__(self, "offload", OffloadPolicy(device=self.offload))
        elif self.offload is not None and not isinstance(self.offload, OffloadPolicy):
            raise ValueError(
                f"offload must be an OffloadPolicy, 'cpu', 'nvme' or None, got {self.offload!r}"
            )
