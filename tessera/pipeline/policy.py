"""The knobs of pipeline and hybrid (dp x tp x pp) training: one frozen dataclass each.

`tessera.setup(model, optimizer, strategy="pipeline", **options)` turns its options into a
`PipelinePolicy`, `strategy="hybrid"` into a `HybridPolicy`; the CLI builds the same objects, so
each knob has one default and one check (`ValueError` in `__post_init__`, before any process
trains).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tessera.pipeline.schedule import SCHEDULES, check_virtual_stages

__all__ = ["HybridPolicy", "PipelinePolicy"]


def _split(split: Sequence[str] | None) -> tuple[str, ...] | None:
    if split is None:
        return None
    if isinstance(split, str) or not all(isinstance(s, str) and s for s in split):
        raise ValueError(f"split must be a list of module names, got {split!r}")
    if len(set(split)) != len(split):
        raise ValueError(f"split={list(split)} names a module twice: the stage between is empty")
    return tuple(split)


def _check_pipeline(microbatches: Any, schedule: Any, virtual_stages: Any) -> None:
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches must be a positive int, got {microbatches!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {SCHEDULES}")
    check_virtual_stages(schedule, virtual_stages)


@dataclass(kw_only=True, frozen=True)
class PipelinePolicy:
    """Every rank one pipeline stage of the model."""

    split: tuple[str, ...] | None = None
    """Names of the modules where a new stage starts (one fewer than the ranks), as
    `torch.distributed.pipelining`'s `SplitPoint.BEGINNING`; None: an `nn.Sequential` is cut by
    parameter count, the reference GPT after equal numbers of blocks."""
    microbatches: int = 4
    """Micro-batches each batch is cut into (on dim 0 of every tensor)."""
    schedule: str = "1f1b"
    """Order of the micro-batches' forward and backward passes: "naive", "gpipe", "1f1b" or
    "interleaved" (1F1B over `virtual_stages` model chunks per rank; microbatches a multiple of
    the stages; `split` then names p*v - 1 layers of an `nn.Sequential`)."""
    virtual_stages: int = 1
    """Model chunks per rank (v): 1, or >= 2 with schedule "interleaved" (bubble / v)."""
    defer_weight_grads: bool | None = None
    """Compute linear weight gradients in one W pass per step (None: when microbatches > 1 and
    the stage runs the model's own modules)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "split", _split(self.split))
        _check_pipeline(self.microbatches, self.schedule, self.virtual_stages)


@dataclass(kw_only=True, frozen=True)
class HybridPolicy:
    """Data x tensor x pipeline parallelism: dp * tp * pp ranks (pp 0: what dp and tp leave)."""

    dp: int = 1
    """Data-parallel replicas; each takes 1/dp of the global batch's rows."""
    tp: int = 1
    """Tensor-parallel ranks inside each stage (needs `plan`, or the reference GPT)."""
    pp: int = 0
    """Pipeline stages; 0: world size / (dp * tp)."""
    zero: int = 0
    """0, or 1 / 2: ZeRO-1 / ZeRO-2 over the dp axis inside each stage."""
    split: tuple[str, ...] | None = None
    """As `PipelinePolicy.split`."""
    microbatches: int = 4
    """As `PipelinePolicy.microbatches`."""
    schedule: str = "1f1b"
    """As `PipelinePolicy.schedule`."""
    virtual_stages: int = 1
    """As `PipelinePolicy.virtual_stages`."""
    plan: Mapping[str, str] | None = None
    """Tensor-parallel plan {module-name pattern: style}, applied with
    `tessera.tensor_parallel.parallelize`; None with tp > 1: the GPT's own `parallelize_gpt`."""
    bucket_cap_mb: float = 25.0
    """Gradient bucket size of the dp reduction inside each stage."""
    defer_weight_grads: bool | None = None
    """As `PipelinePolicy.defer_weight_grads`."""
    find_unused_parameters: bool = False
    """dp > 1: a stage parameter that gets no gradient in a step (an unused head) is left out
    (`.grad` None on every replica, as on one process), as with PyTorch DDP's knob of this name;
    off, it is an error naming it. With zero=1/2 it steps with a zero gradient (weight decay
    applies), as ZeRO steps its flat slices whole."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "split", _split(self.split))
        _check_pipeline(self.microbatches, self.schedule, self.virtual_stages)
        if not isinstance(self.find_unused_parameters, bool):
            raise ValueError(
                f"find_unused_parameters must be True or False, got {self.find_unused_parameters!r}"
            )
        for axis in ("dp", "tp"):
            value = getattr(self, axis)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{axis} must be a positive int, got {value!r}")
        if not isinstance(self.pp, int) or self.pp < 0:
            raise ValueError(f"pp must be a non-negative int (0: the rest), got {self.pp!r}")
        if self.zero not in (0, 1, 2):
            raise ValueError(f"zero must be 0, 1 or 2 inside pipeline stages, got {self.zero}")
        if self.plan is not None:
            if not isinstance(self.plan, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in self.plan.items()
            ):
                raise ValueError(f"plan must map module-name patterns to styles, got {self.plan!r}")
            object.__setattr__(self, "plan", dict(self.plan))
        if self.bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {self.bucket_cap_mb}")
