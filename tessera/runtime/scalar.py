"""`DeviceScalar`: a number computed on the device, read by the host only when asked.

A Python float would be read from the GPU where it is computed: the host then waits for the
device's queue to drain, and the next kernels are not queued while the GPU finishes these (the
plain loop that never calls `.item()` keeps the GPU busy; on an H100 that wait cost tessera 7%
of a GPT-2-small step). So a step's loss (`tessera.strategies.StepLoss`) and a clipped gradient
norm (`tessera.optim.clip.clip_grad_norm`) are this small number-like object: it holds a scalar
tensor on its device and, where the value is averaged over ranks, the all-reduce in flight (started
asynchronously, never waited for by the step). `float(x)`, printing, formatting, comparisons and
arithmetic read it then (one sync, once; the value is kept). Pickling turns it into a plain
float (a rank's return value travels to the launcher so). `torch.tensor(x)` does not take it:
`x.tensor()` is the device tensor, `float(x)` the number.
"""

from __future__ import annotations

import numbers
from typing import Any

import torch
import torch.distributed as dist

from tessera.runtime.devices import collective_device

__all__ = ["DeviceScalar"]


class DeviceScalar:
    """A value held on its device (and, if averaged over ranks, its all-reduce in flight), read
    into a float at the first use."""

    __slots__ = ("_divisor", "_tensor", "_value", "_work")

    def __init__(
        self, value: torch.Tensor | float, *, work: Any = None, divisor: float = 1.0
    ) -> None:
        self._tensor = value if isinstance(value, torch.Tensor) else None
        self._value: float | None = None if self._tensor is not None else float(value)
        self._work = work
        self._divisor = float(divisor)

    @classmethod
    def mean_over(cls, local: torch.Tensor, group: dist.ProcessGroup | None = None) -> Any:
        """The mean of `local` (a scalar) over the ranks of `group`: the sum is all-reduced
        asynchronously on the group's device (NCCL: this rank's GPU) and waited for when read.

        Collective: every rank of `group` calls it at the same point (the end of a step, when
        no communication stream has work queued, `tessera.comm.stream`). Returns an instance
        of `cls`.
        """
        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            return cls(local.detach())
        buffer = local.detach().float().reshape(1).to(collective_device(group), copy=True)
        work = dist.all_reduce(buffer, group=group, async_op=True)
        return cls(buffer, work=work, divisor=dist.get_world_size(group))

    def tensor(self) -> torch.Tensor:
        """The loss as a scalar tensor on its device (the all-reduce waited for: on CUDA the
        current stream waits, the host does not)."""
        if self._tensor is None:
            return torch.tensor(self._value)
        self._wait()
        return self._tensor.reshape(()) / self._divisor

    def _wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None

    def __float__(self) -> float:
        if self._value is None:
            self._wait()
            self._value = self._tensor.reshape(()).item() / self._divisor  # the one host sync
            self._tensor = None
        return self._value

    def __reduce__(self) -> tuple[type, tuple[float]]:
        return float, (float(self),)

    def __repr__(self) -> str:
        return repr(float(self))

    def __str__(self) -> str:
        return str(float(self))

    def __format__(self, spec: str) -> str:
        return format(float(self), spec)

    def __bool__(self) -> bool:
        return bool(float(self))

    def __hash__(self) -> int:
        return hash(float(self))

    def __int__(self) -> int:
        return int(float(self))

    def __round__(self, ndigits: int | None = None) -> Any:
        return round(float(self), ndigits)

    def __neg__(self) -> float:
        return -float(self)

    def __pos__(self) -> float:
        return float(self)

    def __abs__(self) -> float:
        return abs(float(self))

    def __eq__(self, other: object) -> bool:
        return float(self) == other

    def __ne__(self, other: object) -> bool:
        return float(self) != other

    def __lt__(self, other: Any) -> bool:
        return float(self) < other

    def __le__(self, other: Any) -> bool:
        return float(self) <= other

    def __gt__(self, other: Any) -> bool:
        return float(self) > other

    def __ge__(self, other: Any) -> bool:
        return float(self) >= other

    def __add__(self, other: Any) -> Any:
        return float(self) + other

    def __radd__(self, other: Any) -> Any:
        return other + float(self)

    def __sub__(self, other: Any) -> Any:
        return float(self) - other

    def __rsub__(self, other: Any) -> Any:
        return other - float(self)

    def __mul__(self, other: Any) -> Any:
        return float(self) * other

    def __rmul__(self, other: Any) -> Any:
        return other * float(self)

    def __truediv__(self, other: Any) -> Any:
        return float(self) / other

    def __rtruediv__(self, other: Any) -> Any:
        return other / float(self)

    def __pow__(self, other: Any) -> Any:
        return float(self) ** other


numbers.Real.register(DeviceScalar)
