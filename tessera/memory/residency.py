"""The residency scheduler: which block's parameters must be in memory, and when.

ZeRO-3 (`tessera/zero/stage3.py`: a unit's parameters all-gathered from the ranks' shards) and
GeePS swapping (`tessera/memory/swap.py`: a block's parameters read back from a file or a host
copy) solve the same problem: a block's storage is empty between uses, yet every use must find
it full. The owner decides what "bringing a block in" means; this scheduler says when, from three
signals that hold for any `nn.Module`, however its forward calls its children:

* saved-tensor hooks: a tensor autograd saves that lives in a block's storage is packed as
  "block b's tensor", and unpacking it in backward brings block b in first (and prefetches the
  blocks before it). Backward therefore never reads an emptied storage, even after a
  `torch.no_grad()` forward emptied everything, in a second backward, or in a re-entrant one;
* a prefetch window: the order in which blocks were first used in the last forward with
  gradients (module order before that); forward looks `ahead` of a block, backward `behind` it;
* the end of backward: a callback queued on autograd's engine once per backward graph task, and
  a count of the gradients that have arrived per block, so an owner can empty a block as soon as
  backward is done with it.

The end-of-backward callback is queued once per graph task id, not once per process under a
boolean: a re-entrant backward (activation checkpointing's recomputation runs its own graph task
inside the outer one) or a second backward on another thread each get their own callback, and a
backward that raised half-way (its callback never runs) does not leave a flag set that would
keep every later backward from being noticed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["ResidencyScheduler", "in_backward", "storage_key"]


def storage_key(tensor: torch.Tensor) -> int | None:
    """Identity of a tensor's storage: the same for every view, kept across `resize_`."""
    try:
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # no storage (sparse, some subclasses)
        return None


def in_backward() -> bool:
    """Is the calling thread running a backward graph task (autograd's engine)?"""
    return torch._C._current_graph_task_id() != -1


class _Saved:
    """What the saved-tensor hook keeps for a tensor that lives in block `block`'s storage."""

    __slots__ = ("block", "tensor")

    def __init__(self, block: int, tensor: torch.Tensor) -> None:
        self.block = block
        self.tensor = tensor


class ResidencyScheduler:
    """Saved-tensor hooks, prefetch window and end-of-backward for blocks `0..count-1`.

    The owner supplies `bring_in(block)` (block complete in memory on return), `prefetch(block)`
    (start bringing it in; may decline) and `end_of_backward()`; every call happens under `lock`,
    the owner's, since backward hooks may run on autograd's worker threads. `window`: how many
    blocks behind one being unpacked in backward are prefetched. `keep_unseen`: blocks the last
    forward did not use stay at the end of the order (prefetched after the used ones) rather than
    out of it (never prefetched).
    """

    def __init__(
        self,
        count: int,
        *,
        bring_in: Callable[[int], None],
        prefetch: Callable[[int], Any],
        end_of_backward: Callable[[], None],
        lock: threading.RLock,
        window: int = 1,
        keep_unseen: bool = False,
    ) -> None:
        self._count = count
        self._bring_in = bring_in
        self._prefetch = prefetch
        self._end_callback = end_of_backward
        self._lock = lock
        self.window = window
        self._keep_unseen = keep_unseen
        self._block_of_storage: dict[int, int] = {}
        self._order: list[int] = list(range(count))
        self._position = {block: at for at, block in enumerate(self._order)}
        self._recording: list[int] = []
        self._arrived: dict[int, set[int]] = {}
        self._end_queued: set[int] = set()

    # -- saved-tensor hooks ---------------------------------------------------------------------
    def track(self, tensor: torch.Tensor, block: int) -> None:
        """Tensors saved for backward that share `tensor`'s storage belong to `block`."""
        key = storage_key(tensor)
        if key is not None:
            self._block_of_storage[key] = block

    def saved_tensors_hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """A context manager packing the tensors saved inside it by block (enter it once per
        forward; `__exit__` when the forward returns)."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> Any:
        block = self._block_of_storage.get(storage_key(tensor))
        return tensor if block is None else _Saved(block, tensor)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Saved):
            return packed
        with self._lock:
            self.queue_end_of_backward()
            self._bring_in(packed.block)
            for block in self.behind(packed.block, self.window):
                self._prefetch(block)
        return packed.tensor

    # -- the prefetch window --------------------------------------------------------------------
    def start_recording(self) -> None:
        """A forward begins: record the order in which its blocks are first used."""
        self._recording = []

    def record(self, block: int) -> bool:
        """`block` runs in this forward; True the first time (the moment to prefetch ahead)."""
        if block in self._recording:
            return False
        self._recording.append(block)
        return True

    def adopt_recording(self) -> None:
        """The forward (with gradients) ended: its order is the prefetch order from now on."""
        if not self._recording:
            return
        order = list(self._recording)
        if self._keep_unseen:
            seen = set(order)
            order += [block for block in range(self._count) if block not in seen]
        self._order = order
        self._position = {block: at for at, block in enumerate(order)}

    @property
    def last_in_order(self) -> int | None:
        """The block used last in forward: backward starts with it."""
        return self._order[-1] if self._order else None

    def ahead(self, block: int, count: int) -> list[int]:
        """The `count` blocks that follow `block` in the order (none if it is not in it)."""
        at = self._position.get(block)
        return [] if at is None else self._order[at + 1 : at + 1 + count]

    def behind(self, block: int, count: int) -> list[int]:
        """The `count` blocks before `block` in the order, nearest first."""
        at = self._position.get(block)
        return [] if at is None else self._order[max(0, at - count) : at][::-1]

    # -- gradients and the end of backward ------------------------------------------------------
    def gradient_arrived(self, block: int, param: torch.Tensor, expected: int) -> bool:
        """Count `param`'s gradient of `block`; True once its `expected` ones all arrived."""
        self.queue_end_of_backward()
        arrived = self._arrived.setdefault(block, set())
        arrived.add(id(param))
        if len(arrived) < expected:
            return False
        del self._arrived[block]
        return True

    def queue_end_of_backward(self) -> None:
        """Have `end_of_backward` run when the running backward graph task ends (once per task)."""
        task = torch._C._current_graph_task_id()
        if task != -1 and task not in self._end_queued:  # -1: not inside a backward
            self._end_queued.add(task)
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: self._end_of_backward(task)
            )

    def _end_of_backward(self, task: int) -> None:
        with self._lock:
            self._end_queued.discard(task)
            self._arrived.clear()
            self._end_callback()
