"""One-step delayed parameter update (DPU) of ZeRO-Offload: the host step runs beside the next
forward and backward.

Ren et al., "ZeRO-Offload: Democratizing Billion-Scale Model Training" (USENIX ATC 2021),
section 5: with the step on the host, the CPU optimizer step is often the longest part of an
iteration. DPU overlaps it with the next iteration's compute: the step of iteration t runs in a
background thread while iteration t+1's forward and backward run on the parameters from before
that step, and its result becomes visible when iteration t+1 reaches its own step. From then on
the update applied at step t uses the gradient computed at the parameters of step t-1 (one step
stale); the paper shows that convergence is unharmed once the first steps, when the gradients
change fast, run without delay: `delayed_update_after` of them (default 40 here: the paper says
"a few dozen"; tessera's own choice, not a figure from the paper).

`ZeroOptimizer` holds this object and calls it (`take_step`, `finish`, `wait`) with what it
needs: the shard layout (`tessera.zero.shards`: the flats and their gradient slices), the inner
optimizer and the stage's `publish`, never the optimizer itself. Its rules keep the delayed step
race free:

* the step reads its own gradient partition, which the next backward does not write: the host
  link's set itself where the step reads it as it is (float32, or bf16 for CPUAdam), the link
  taking its other set for the next backward's copies (`HostLink.hand_over`, no copy made);
  else a float32 copy (`grads`, filled on the training thread at launch);
* the master weights are never the parameters forward reads (under DPU a stage 1/2 fp32 master
  is a copy, not a view of the flat buffer; a stage 3 shard is a copy of its master), so the
  step writes memory that no forward touches;
* the thread issues no collective: publishing (stages 1/2 all-gather the new slices, stage 3
  copies them into the gathered shards) runs on the training thread at the start of the next
  `step`, after that iteration's backward and before the next forward, in the same place on
  every rank, through the group's ordered stream (`tessera.comm.stream`);
* everything that reads the optimizer's state or hyper-parameters (`param_groups`, checkpoints,
  `full_parameters`) first waits for the step in flight.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from tessera.runtime.wait import wait_or_raise
from tessera.zero.masters import reads_bf16, step_keywords

if TYPE_CHECKING:
    from tessera.zero.shards import ShardLayout

__all__ = ["DEFAULT_WARMUP_STEPS", "DelayedUpdate", "check_collaborators", "check_delayed_update"]

DEFAULT_WARMUP_STEPS = 40
"""Steps without delay before DPU starts ("a few dozen" in the paper; this value is ours)."""


def check_delayed_update(
    delayed_update: bool, after: int, *, offload: str | None = "cpu", stage: int = 1
) -> None:
    """Refuse a DPU setting that cannot run, with one message (shared by initialize and config)."""
    if not isinstance(delayed_update, bool):
        raise ValueError(f"delayed_update must be True or False, got {delayed_update!r}")
    if isinstance(after, bool) or not isinstance(after, int) or after < 1:
        raise ValueError(
            f"delayed_update_after must be an integer >= 1 (the first step builds the optimizer "
            f"state on the training thread), got {after!r}"
        )
    if not delayed_update:
        return
    if offload != "cpu":
        raise ValueError(
            f"delayed_update overlaps ZeRO-Offload's host step with the next forward/backward: "
            f"it needs offload='cpu', not offload={offload!r}"
        )
    if stage not in (1, 2, 3):
        raise ValueError(f"delayed_update needs ZeRO stage 1, 2 or 3, not stage {stage}")


def check_collaborators(delayed_update: bool, after: int, swap_masters: bool) -> None:
    """Refuse a delayed update that cannot run, and one beside masters in files."""
    # Any element-wise inner optimizer may be delayed here; `initialize` and the trainer
    # allow it with offload="cpu" only (the paper's setting: the step runs on the host).
    check_delayed_update(delayed_update, after, offload="cpu")
    if delayed_update and swap_masters:
        raise ValueError(
            "delayed_update cannot run with the masters in files (offload='nvme'): the "
            "swapped step streams them through shared buffers on the training thread"
        )


class DelayedUpdate:
    """The background step of one `ZeroOptimizer`: one worker thread, one step in flight."""

    def __init__(self, after: int, rank: int, timeout_s: float) -> None:
        self.after = after
        """Steps run without delay before the first delayed one."""
        self.steps = 0
        """Steps taken so far (launched ones included); the same on every rank."""
        self.unpublished = False
        """A step has run (or runs) whose result the module's parameters do not show yet."""
        self.grads: list[torch.Tensor] = []
        """The step's own copy of the gradient partition, one fp32 tensor per flat shard."""
        self._rank = rank
        self._timeout_s = timeout_s
        self._future: Future | None = None
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._threads = torch.get_num_threads()  # the training thread's setting, for the worker

    @property
    def delaying(self) -> bool:
        """Is the next step delayed (warm-up over)?"""
        return self.steps >= self.after

    def launch(self, step: Callable[[], None]) -> None:
        """Run `step()` on the worker thread (one step at a time: the last one has finished).

        One long-lived worker, not a thread per step: its OpenMP team (CPUAdam's threads) is
        made once, as the training thread's is."""
        assert self._future is None, "a delayed step is still in flight"
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._work, name=f"tessera-delayed-step-{self._rank}"
            )
            self._thread.daemon = True  # a rank that fails elsewhere must still exit
            self._thread.start()
        self._future = Future()
        self.unpublished = True
        self._tasks.put((self._future, step))

    def _work(self) -> None:
        torch.set_num_threads(self._threads)
        while True:
            future, step = self._tasks.get()
            try:
                step()
            except BaseException as error:  # noqa: BLE001 - re-raised on the training thread
                future.set_exception(error)
            else:
                future.set_result(None)

    def wait(self) -> None:
        """Block until the step in flight (if any) has finished; re-raise its error."""
        future, self._future = self._future, None
        if future is None:
            return
        wait_or_raise(
            future,
            "the delayed (background) optimizer step",
            self._timeout_s,
            self._rank,
            "the host optimizer step did not finish; it may be stuck or far too slow",
        )

    def grad_buffers(self, masters: list[torch.Tensor]) -> list[torch.Tensor]:
        """The step's float32 gradient copies, one like each master (made at the first delayed
        step that needs them)."""
        if not self.grads:
            self.grads = [torch.zeros_like(master, dtype=torch.float32) for master in masters]
        return self.grads

    def finish(self, publish: Callable[[], None]) -> None:
        """Wait for the step in flight and publish its result with the stage's `publish`
        (collective on stages 1/2), on the training thread."""
        self.wait()
        if self.unpublished:
            publish()
            self.unpublished = False

    def take_step(self, layout: ShardLayout, optimizer: Any, publish: Callable[[], None]) -> bool:
        """Publish the step in flight, then launch this one of the inner `optimizer` on the
        masters of `layout` in the background; False during the warm-up (the step then runs in
        place, as without DPU). Every branch is taken alike on every rank (the step count is
        the same everywhere)."""
        self.finish(publish)
        if not self.delaying:
            self.steps += 1
            return False
        # The step's own gradient partition: the next backward (and zero_grad) write the
        # stage's buffers while the step reads this one. The host link's set itself where the
        # step reads it as it is (float32, or bf16 for CPUAdam): the link takes its other set
        # for the next backward (`HostLink.hand_over`), nothing is copied on this thread. Else a
        # float32 copy (a bf16 or fp16 partition for another optimizer).
        masters = [flat.master for flat in layout.flats]
        sources = [layout.step_gradient(flat) for flat in layout.flats]
        readable = {torch.float32, torch.bfloat16} if reads_bf16(optimizer) else {torch.float32}
        if layout.link is not None and all(source.dtype in readable for source in sources):
            copies = layout.link.hand_over()
        else:
            copies = self.grad_buffers(masters)
            for copy, source in zip(copies, sources):
                copy.copy_(source)
        for master, copy in zip(masters, copies):
            master.grad = copy if copy.dtype == master.dtype else None
        # The step's own keywords: CPUAdam's bf16 gradients (these copies) and bf16_out (the
        # staging buffers, sent by the publish that follows this step's wait).
        keywords = step_keywords(layout, optimizer, dict(zip(map(id, masters), copies)))
        self.steps += 1
        # The step's own copy of the hyper-parameters, taken here on the training thread: a
        # learning-rate scheduler sets the next step's lr in `param_groups` while this one runs.
        groups = [dict(group) for group in optimizer.param_groups]
        self.launch(partial(_step_with_groups, optimizer, groups, masters, keywords))
        return True


def _step_with_groups(
    optimizer: Any, groups: list[dict[str, Any]], masters: list, keywords: dict[str, list]
) -> None:
    """The background half of a delayed step: the inner optimizer on the masters only, with the
    hyper-parameters `groups` held when it was launched.

    It runs on a shallow twin of the inner optimizer whose `param_groups` are `groups`: the twin
    shares the state (moments, step counts) and the parameters, so the step updates them as the
    optimizer itself would, while the training thread may already set the next step's learning
    rate in the optimizer's own groups. `keywords`: the step's own (`step_keywords`)."""
    twin = object.__new__(type(optimizer))
    twin.__dict__.update(optimizer.__dict__)
    twin.__dict__.pop("step", None)  # an instance wrapper (lr schedulers) steps the original
    twin.param_groups = groups
    with torch.no_grad():
        type(optimizer).step(twin, **keywords)
    for master in masters:
        master.grad = None
