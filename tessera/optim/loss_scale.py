"""Dynamic loss scaling for fp16 training: why, and the one rule every strategy applies.

fp16 has 5 exponent bits: its smallest normal number is 2^-14 (subnormals reach 2^-24), and
many gradients of a trained model are smaller than that, so in fp16 they flush to zero.
Multiplying the loss by a scale S before backward multiplies every gradient by S (backward is
linear in the loss) and lifts them into fp16's range; the step divides them by S again before
clipping and the optimizer, so the update is the unscaled one. A scale too large overflows:
some gradient becomes inf or nan. Then the step is skipped (no parameter, no optimizer state
changes), and S is halved. After `growth_interval` clean steps in a row S doubles, probing for
the largest scale that does not overflow (Micikevicius et al., "Mixed Precision Training",
ICLR 2018; the defaults are `torch.amp.GradScaler`'s).

Across ranks the decision must be one: under ZeRO, pipeline or tensor parallelism each rank
holds different gradients, so an inf on one rank alone must skip the step on every rank, or the
replicas/shards diverge. `unscale_and_check` takes an `all_reduce` that sums a one-element flag
over the ranks that step together: one small collective per step.

A skipped step is counted (`skipped`), and `state_dict` holds the scale, the clean-step count
and that counter, so a resumed run scales exactly as the run that never stopped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["DynamicLossScaler"]

AllReduceSum = Callable[[torch.Tensor], torch.Tensor]
"""Sums a tensor over the ranks that step together; returns the sum (in place or not)."""


class DynamicLossScaler:
    """The loss scale S of fp16 training: scale the loss, unscale and check the gradients.

    `init_scale` 2^16, `growth_factor` 2, `backoff_factor` 0.5 and `growth_interval` 2000 are
    `torch.amp.GradScaler`'s defaults. Powers of two keep scaling and unscaling exact (only the
    exponent changes) as long as nothing overflows or becomes subnormal.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        *,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        if not (isinstance(init_scale, (int, float)) and math.isfinite(init_scale)) or not (
            init_scale > 0
        ):
            raise ValueError(f"init_scale must be a positive finite number, got {init_scale!r}")
        if not growth_factor > 1:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor!r}")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor!r}")
        if isinstance(growth_interval, bool) or not (
            isinstance(growth_interval, int) and growth_interval >= 1
        ):
            raise ValueError(f"growth_interval must be an int >= 1, got {growth_interval!r}")
        self._host = {"scale": float(init_scale), "clean_steps": 0, "skipped": 0}
        self._device: dict[str, torch.Tensor] | None = None  # the same, held on the device
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval

    scale = property(
        lambda self: self._get("scale"),
        lambda self, value: self._set("scale", value),
        doc="The factor the next backward's loss is multiplied by.",
    )
    clean_steps = property(
        lambda self: self._get("clean_steps"),
        lambda self, value: self._set("clean_steps", value),
        doc="Steps without inf/nan since the last change of the scale.",
    )
    skipped = property(
        lambda self: self._get("skipped"),
        lambda self, value: self._set("skipped", value),
        doc="Steps skipped because a gradient was inf or nan (on any rank), over the run.",
    )

    def _get(self, name: str) -> Any:
        """A value of the state (read from the device, a sync, where `update_on_device` holds
        it there: only when asked, as a logged step or a checkpoint does)."""
        if self._device is None:
            return self._host[name]
        value = self._device[name].item()
        return float(value) if name == "scale" else int(value)

    def _set(self, name: str, value: Any) -> None:
        if self._device is None:
            self._host[name] = float(value) if name == "scale" else int(value)
        else:
            self._device[name].fill_(value)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss * scale`: what backward runs on (the device's scale where it is held there)."""
        if self._device is not None:
            return loss * self._device["scale"]
        return loss * self._host["scale"]

    @torch.no_grad()
    def unscale_and_check(
        self, grads: Iterable[torch.Tensor | None], all_reduce: AllReduceSum | None = None
    ) -> bool:
        """Divide `grads` by the scale in place; True if any gradient on any rank is inf/nan.

        `all_reduce` sums the flag over the ranks that step together (None: this process
        alone). Every such rank must call this, each with its own gradients. Then `update`.
        The answer is read by the host (one sync a step); `unscale_and_flag` leaves it on the
        device.
        """
        return bool(self.unscale_and_flag(grads, all_reduce).item() > 0)

    @torch.no_grad()
    def unscale_and_flag(
        self, grads: Iterable[torch.Tensor | None], all_reduce: AllReduceSum | None = None
    ) -> torch.Tensor:
        """`unscale_and_check` without reading the answer: a 0-dim float32 tensor, 1.0 where a
        gradient on any rank is inf/nan, else 0.0 (on the first gradient's device)."""
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for grad in grads:
            if grad is not None:
                groups.setdefault((grad.device, grad.dtype), []).append(grad)
        # one flag per device, set by the check-and-unscale kernel GradScaler uses: no host
        # sync per gradient (CUDA), one read of the flag after the ranks agree
        flags: dict[torch.device, torch.Tensor] = {}
        for (device, _), members in groups.items():
            flag = flags.setdefault(device, torch.zeros(1, dtype=torch.float32, device=device))
            torch._amp_foreach_non_finite_check_and_unscale_(members, flag, self._inverse(device))
        found = list(flags.values())
        bad = found[0] if found else torch.zeros(1, dtype=torch.float32)  # (no gradient: clean)
        for flag in found[1:]:
            bad = bad + flag.to(bad.device)
        if all_reduce is not None:
            bad = all_reduce(bad.clamp(max=1.0))  # the ranks' sum: how many ranks saw inf/nan
        return bad.clamp(max=1.0).reshape(())  # a flag (an optimizer subtracts it from steps)

    def _inverse(self, device: torch.device) -> torch.Tensor:
        """1 / scale as the (1,) float32 tensor the unscale kernel takes, on `device`."""
        if self._device is not None:
            return self._device["scale"].to(device).reciprocal().reshape(1)
        return torch.full((1,), 1.0 / self._host["scale"], dtype=torch.float32, device=device)

    @torch.no_grad()
    def update_on_device(self, found_inf: torch.Tensor) -> None:
        """`update` without reading `found_inf` (a 0-dim 0/1 flag from `unscale_and_flag`): the
        scale, the clean-step count and the skip count move to `found_inf`'s device at the first
        call and are updated there by torch's `_amp_update_scale_` (GradScaler's rule, which is
        `update`'s: back off on inf/nan, grow after `growth_interval` clean steps)."""
        if self._device is None:
            dtypes = {"scale": torch.float32, "clean_steps": torch.int32, "skipped": torch.int64}
            self._device = {
                name: torch.full((), self._host[name], dtype=dtype, device=found_inf.device)
                for name, dtype in dtypes.items()
            }
        state = self._device
        state["skipped"].add_(found_inf.to(torch.int64))
        torch._amp_update_scale_(
            state["scale"], state["clean_steps"], found_inf, self.growth_factor,
            self.backoff_factor, self.growth_interval,
        )  # fmt: skip

    def update(self, found_inf: bool) -> None:
        """After a step's check: back off (and count the skip) on inf/nan, else maybe grow."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.skipped += 1
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict[str, Any]:
        """Everything that decides the next scales: for checkpoints (exact resume)."""
        return {
            "scale": self.scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "clean_steps": self.clean_steps,
            "skipped": self.skipped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        self.scale = float(state["scale"])
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped = int(state["skipped"])
