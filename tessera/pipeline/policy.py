"""The knobs of pipeline and hybrid (dp x tp x pp) training: one frozen dataclass each.

`tessera.setup(model, optimizer, strategy="pipeline", **options)` turns its options into a
`PipelinePolicy`, `strategy="hybrid"` into a `HybridPolicy`; the CLI builds the same objects, so
each knob has one default and one check (`ValueError` in `__post_init__`, before any process
trains).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any

from tessera.data_parallel.policy import DDPPolicy
from tessera.pipeline.schedule import SCHEDULES, check_virtual_stages
from tessera.tensor_parallel.policy import TensorPolicy

_KEEP: Any = object()
"""A knob not given by name: the part's own value stands."""

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

    split: tuple[str, ...] | None = field(
        default=None,
        metadata={
            "help": "pipeline, hybrid with --model: module names where a new stage starts, "
            "comma-separated.",
            "config_type": str | None,
        },
    )
    """Names of the modules where a new stage starts (one fewer than the ranks), as
    `torch.distributed.pipelining`'s `SplitPoint.BEGINNING`; None: an `nn.Sequential` is cut by
    parameter count, the reference GPT after equal numbers of blocks."""
    microbatches: int = field(
        default=4, metadata={"help": "pipeline, hybrid: micro-batches per step."}
    )
    """Micro-batches each batch is cut into (on dim 0 of every tensor)."""
    schedule: str = field(
        default="1f1b",
        metadata={"help": "pipeline, hybrid: naive, gpipe, 1f1b or interleaved."},
    )
    """Order of the micro-batches' forward and backward passes: "naive", "gpipe", "1f1b" or
    "interleaved" (1F1B over `virtual_stages` model chunks per rank; microbatches a multiple of
    the stages; `split` then names p*v - 1 layers of an `nn.Sequential`)."""
    virtual_stages: int = field(
        default=1,
        metadata={
            "help": "pipeline, hybrid: model chunks per rank, >= 2 with --schedule interleaved."
        },
    )
    """Model chunks per rank (v): 1, or >= 2 with schedule "interleaved" (bubble / v)."""
    defer_weight_grads: bool | None = None
    """Compute linear weight gradients in one W pass per step (None: when microbatches > 1 and
    the stage runs the model's own modules)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "split", _split(self.split))
        _check_pipeline(self.microbatches, self.schedule, self.virtual_stages)
        if not (self.defer_weight_grads is None or isinstance(self.defer_weight_grads, bool)):
            raise ValueError(
                f"defer_weight_grads must be True, False or None, got {self.defer_weight_grads!r}"
            )


_PARTS = {
    "pipeline": ("split", "microbatches", "schedule", "virtual_stages", "defer_weight_grads"),
    "tensor": ("plan",),
    "data": ("bucket_cap_mb", "find_unused_parameters"),
}
"""The knobs of each part of the mix, which `HybridPolicy` also takes (and reads) by name."""


@dataclass(kw_only=True, frozen=True, init=False)
class HybridPolicy:
    """Data x tensor x pipeline parallelism: dp * tp * pp ranks (pp 0: what dp and tp leave).

    It holds the policies of its parts, each with its knobs' one default and one check: the
    pipeline's (`PipelinePolicy`), the tensor-parallel one inside each stage (`TensorPolicy`) and
    the data-parallel reduction over each stage's replicas (`DDPPolicy`). Their knobs are also
    taken and read by name (`HybridPolicy(dp=2, microbatches=8)`, `policy.microbatches`), as
    `tessera.setup(strategy="hybrid", ...)` passes them.
    """

    dp: int = field(default=1, metadata={"help": "hybrid: data-parallel degree."})
    """Data-parallel replicas; each takes 1/dp of the global batch's rows."""
    tp: int = field(default=1, metadata={"help": "hybrid: tensor-parallel degree."})
    """Tensor-parallel ranks inside each stage (needs `plan`, or the reference GPT)."""
    pp: int = field(
        default=0,
        metadata={"help": "hybrid: pipeline stages; 0 takes the ranks left by dp and tp."},
    )
    """Pipeline stages; 0: world size / (dp * tp)."""
    zero: int = field(
        default=0,
        metadata={
            "help": "hybrid: 1 shards optimizer states, 2 also gradients, over each stage's dp "
            "group."
        },
    )
    """0, or 1 / 2: ZeRO-1 / ZeRO-2 over the dp axis inside each stage."""
    pipeline: PipelinePolicy = field(default_factory=PipelinePolicy)
    """The stages: split, microbatches, schedule, virtual_stages, defer_weight_grads."""
    tensor: TensorPolicy = field(default_factory=TensorPolicy)
    """The tensor-parallel plan {module-name pattern: style}, applied with
    `tessera.tensor_parallel.parallelize`; None with tp > 1: the GPT's own `parallelize_gpt`."""
    data: DDPPolicy = field(default_factory=DDPPolicy)
    """The dp reduction inside each stage: its `bucket_cap_mb`, and `find_unused_parameters`
    (dp > 1: a stage parameter that gets no gradient in a step is left out, `.grad` None on
    every replica as on one process; off, it is an error naming it; with zero=1/2 it steps with
    a zero gradient, as ZeRO steps its flat slices whole)."""

    def __init__(
        self,
        *,
        dp: int = _KEEP,
        tp: int = _KEEP,
        pp: int = _KEEP,
        zero: int = _KEEP,
        pipeline: PipelinePolicy = _KEEP,
        tensor: TensorPolicy = _KEEP,
        data: DDPPolicy = _KEEP,
        split: Sequence[str] | None = _KEEP,
        microbatches: int = _KEEP,
        schedule: str = _KEEP,
        virtual_stages: int = _KEEP,
        defer_weight_grads: bool | None = _KEEP,
        plan: Mapping[str, str] | None = _KEEP,
        bucket_cap_mb: float = _KEEP,
        find_unused_parameters: bool = _KEEP,
    ) -> None:
        """The parts (default: each policy's defaults), then each knob given by name on top.

        Why so many parameters: the mix's own four, its three parts, and their knobs by name
        (the keywords `tessera.setup(strategy="hybrid", ...)` has always taken)."""
        given = {k: v for k, v in locals().items() if v is not _KEEP and k != "self"}
        for own in fields(self):  # the mix's own knobs and its parts (their defaults: above)
            default = own.default_factory() if own.default is MISSING else own.default
            object.__setattr__(self, own.name, given.get(own.name, default))
        for part, names in _PARTS.items():
            changes = {name: given[name] for name in names if name in given}
            if changes:
                object.__setattr__(self, part, replace(getattr(self, part), **changes))
        self.__post_init__()

    def __post_init__(self) -> None:
        for axis in ("dp", "tp"):
            value = getattr(self, axis)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{axis} must be a positive int, got {value!r}")
        if not isinstance(self.pp, int) or self.pp < 0:
            raise ValueError(f"pp must be a non-negative int (0: the rest), got {self.pp!r}")
        if self.zero not in (0, 1, 2):
            raise ValueError(f"zero must be 0, 1 or 2 inside pipeline stages, got {self.zero}")
        parts = {"pipeline": PipelinePolicy, "tensor": TensorPolicy, "data": DDPPolicy}
        for part, cls in parts.items():
            if not isinstance(getattr(self, part), cls):
                raise ValueError(f"{part} must be a {cls.__name__}, got {getattr(self, part)!r}")

    @property
    def split(self) -> tuple[str, ...] | None:
        """As `PipelinePolicy.split`."""
        return self.pipeline.split

    @property
    def microbatches(self) -> int:
        """As `PipelinePolicy.microbatches`."""
        return self.pipeline.microbatches

    @property
    def schedule(self) -> str:
        """As `PipelinePolicy.schedule`."""
        return self.pipeline.schedule

    @property
    def virtual_stages(self) -> int:
        """As `PipelinePolicy.virtual_stages`."""
        return self.pipeline.virtual_stages

    @property
    def defer_weight_grads(self) -> bool | None:
        """As `PipelinePolicy.defer_weight_grads`."""
        return self.pipeline.defer_weight_grads

    @property
    def plan(self) -> Mapping[str, str] | None:
        """As `TensorPolicy.plan`."""
        return self.tensor.plan

    @property
    def bucket_cap_mb(self) -> float:
        """As `DDPPolicy.bucket_cap_mb`."""
        return self.data.bucket_cap_mb

    @property
    def find_unused_parameters(self) -> bool:
        """As `DDPPolicy.find_unused_parameters`."""
        return self.data.find_unused_parameters
