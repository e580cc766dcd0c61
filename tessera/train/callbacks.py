"""User code inside the training loop: `run_training(config, callbacks=[...])`.

A callback is any object with one or both hooks (subclass `Callback` to get no-op defaults):

    on_step_end(step, metrics)   after every optimizer step
    on_eval_end(step, metrics)   after every evaluation (--eval-every), before that step's
                                 on_step_end

`step` counts the optimizer steps done (1 after the first); `metrics` is the step's record, the
one metrics.jsonl holds (loss averaged over the ranks, lr, tokens_per_s, comm_s, memory, and
val_loss after an evaluation), a copy the callback may keep. Hooks run on rank 0 only, in the
order given; they return None.

Stopping early: a hook raises `StopTraining("why")`. Every rank then stops after that step: the
step is checkpointed (so `--resume` continues from it), logged, and the summary says
`stopped_at` and `stop_reason`. That is the one way to stop; any other exception fails the run
like an error in training does.

Under `nproc > 1` the ranks are processes of their own: the callbacks are pickled to them (rank
0's copy is the one called, so what a callback records stays in that process: write it to a file
or read metrics.jsonl). A callback must therefore be picklable: an instance of a class defined
at the top level of an importable module, not a lambda or a class defined inside a function;
`check_callbacks` refuses others before any rank starts.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from tessera.errors import ConfigError
from tessera.runtime.context import Context

__all__ = ["HOOKS", "Callback", "CallbackRunner", "StopTraining", "check_callbacks"]

HOOKS = ("on_step_end", "on_eval_end")


class StopTraining(Exception):
    """Raised by a callback's hook to end training after the current step (checkpointed)."""


class Callback:
    """Base class of a callback: both hooks do nothing; override the ones you need."""

    def on_step_end(self, step: int, metrics: dict[str, Any]) -> None:
        """After optimizer step `step` (1-based), with the step's metrics; rank 0 only."""

    def on_eval_end(self, step: int, metrics: dict[str, Any]) -> None:
        """After the evaluation at step `step`; `metrics["val_loss"]` is its loss; rank 0 only."""


def check_callbacks(callbacks: Sequence[Any], *, spawned: bool) -> list[Any]:
    """The callbacks as a list; ConfigError for one without hooks, or (when the ranks are
    spawned processes) one that cannot be pickled to them."""
    if isinstance(callbacks, (str, bytes)) or not isinstance(callbacks, Sequence):
        raise ConfigError(f"callbacks must be a list of callback objects, got {callbacks!r}")
    for callback in callbacks:
        if not any(callable(getattr(callback, hook, None)) for hook in HOOKS):
            raise ConfigError(
                f"callback {callback!r} has neither on_step_end nor on_eval_end "
                "(subclass tessera.train.Callback)"
            )
        if spawned:
            try:
                pickle.dumps(callback)
            except Exception as exc:  # pickle raises several types (PicklingError, TypeError...)
                raise ConfigError(
                    f"callback {callback!r} cannot be pickled to the spawned ranks ({exc}): "
                    "define its class at the top level of an importable module (no lambdas, "
                    "no local classes), or run with --nproc 1"
                ) from None
    return list(callbacks)


class CallbackRunner:
    """Calls the hooks on rank 0 and tells every rank whether one asked to stop."""

    def __init__(self, callbacks: Sequence[Any], ctx: Context) -> None:
        self.callbacks = list(callbacks)
        self.ctx = ctx
        self.stop_reason: str | None = None
        """Why a hook stopped training (its StopTraining's message), once one did."""

    @property
    def active(self) -> bool:
        """Whether there are callbacks (then every step gathers its metrics)."""
        return bool(self.callbacks)

    def eval_end(self, step: int, metrics: dict[str, Any]) -> None:
        """Every `on_eval_end(step, metrics)`, on rank 0."""
        self._call("on_eval_end", step, metrics)

    def step_end(self, step: int, metrics: dict[str, Any]) -> None:
        """Every `on_step_end(step, metrics)`, on rank 0."""
        self._call("on_step_end", step, metrics)

    def _call(self, hook: str, step: int, metrics: dict[str, Any]) -> None:
        if not self.ctx.is_main or self.stop_reason is not None:
            return
        for callback in self.callbacks:
            method = getattr(callback, hook, None)
            if method is None:
                continue
            try:
                returned = method(step, dict(metrics))
            except StopTraining as stop:
                self.stop_reason = str(stop) or f"{type(callback).__name__}.{hook}"
                return
            if returned is not None:
                raise TypeError(
                    f"{type(callback).__name__}.{hook} returned {returned!r}: hooks return None; "
                    "to stop training, raise tessera.train.StopTraining"
                )

    def should_stop(self) -> bool:
        """Collective when there are callbacks: rank 0's decision, on every rank."""
        if not self.active:
            return False
        flag = torch.tensor([int(self.stop_reason is not None)], dtype=torch.int64)
        if self.ctx.world_size > 1:
            flag = flag.to(self.ctx.device)
            dist.broadcast(flag, src=0)
        return bool(flag.item())
