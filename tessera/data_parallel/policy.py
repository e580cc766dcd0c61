"""The knobs of data parallelism, one default each: used by `tessera.setup` and `tessera train`.

A policy is a frozen dataclass: validated once, where it is made (a wrong value raises
ValueError naming the field before any process group or bucket exists), and hashable, so it
can travel in a config. `DDPPolicy` drives `DataParallel`; `TorchDDPPolicy` PyTorch's
`DistributedDataParallel`; `LocalSGDPolicy` local SGD.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["DDPPolicy", "LocalSGDPolicy", "TorchDDPPolicy", "check_bucket_cap_mb", "check_flag"]


def check_bucket_cap_mb(bucket_cap_mb: float) -> None:
    """The gradient bucket size's one check (DDP's buckets; ZeRO-1/2 reduce through them too)."""
    if isinstance(bucket_cap_mb, bool) or not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb!r}")


def _check_algorithm(algorithm: str) -> None:
    if not isinstance(algorithm, str) or not algorithm:
        raise ValueError(f"algorithm must be 'auto' or a name of tessera.comm, got {algorithm!r}")
    if algorithm != "auto":
        from tessera.comm import ALGORITHMS  # only then: the collectives are not light

        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {algorithm!r}; use auto or one of {ALGORITHMS}")


@dataclass(kw_only=True, frozen=True)
class DDPPolicy:
    """Bulk-synchronous data parallelism: gradients averaged over the ranks every step."""

    bucket_cap_mb: float = field(
        default=25.0, metadata={"help": "ddp: gradient bucket size in MB."}
    )
    """Gradient bucket size in MB: a bucket's all-reduce starts once its gradients are ready."""
    algorithm: str = field(
        default="auto",
        metadata={
            "knob": "comm_algorithm",
            "help": "ddp, local-sgd: all-reduce algorithm (tessera.comm).",
        },
    )
    """All-reduce algorithm of `tessera.comm` (`auto` chooses by the cost model)."""
    find_unused_parameters: bool = field(
        default=False, metadata={"help": "ddp/torch-ddp/hybrid: allow unused parameters."}
    )
    """PyTorch DDP's knob: after each forward, find the parameters its output does not reach
    (an unused head) and average them as zero gradients; off, such a parameter is an error."""

    def __post_init__(self) -> None:
        check_bucket_cap_mb(self.bucket_cap_mb)
        _check_algorithm(self.algorithm)
        check_flag("find_unused_parameters", self.find_unused_parameters)


def check_flag(name: str, value: object) -> None:
    """A knob that is True or False."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


@dataclass(kw_only=True, frozen=True)
class TorchDDPPolicy:
    """PyTorch's own `DistributedDataParallel` (the anchor): the one knob a model may need."""

    find_unused_parameters: bool = field(
        default=DDPPolicy.find_unused_parameters,
        metadata={"same_as": (DDPPolicy, "find_unused_parameters")},
    )
    """Passed to `DistributedDataParallel` (its meaning: parameters the forward's output does
    not reach are reduced as zero gradients)."""

    def __post_init__(self) -> None:
        check_flag("find_unused_parameters", self.find_unused_parameters)


@dataclass(kw_only=True, frozen=True)
class LocalSGDPolicy:
    """Local SGD: every rank steps on its own gradients, parameters averaged every H steps."""

    average_every: int = field(
        default=8,
        metadata={"help": "local-sgd: average the parameters every this many steps."},
    )
    """H: average the parameters over the ranks every this many steps (1: after every step)."""
    algorithm: str = field(
        default=DDPPolicy.algorithm, metadata={"same_as": (DDPPolicy, "algorithm")}
    )
    """All-reduce algorithm of `tessera.comm` for the parameter average."""

    def __post_init__(self) -> None:
        if isinstance(self.average_every, bool) or not isinstance(self.average_every, int):
            raise ValueError(f"average_every must be an integer, got {self.average_every!r}")
        if self.average_every < 1:
            raise ValueError(f"average_every must be at least 1, got {self.average_every}")
        _check_algorithm(self.algorithm)
