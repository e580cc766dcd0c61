"""One ordered communication stream per process group, shared by every engine on that group.

Collectives pair across ranks by the order in which each rank issues them on a group: the k-th
collective of rank 0 meets the k-th of rank 1. Engines that each own a communication thread (a
GAN's two `DataParallel` wrappers, DDP beside ZeRO) issue in an order that depends on how their
threads happen to be scheduled, which differs per rank: two buckets of equal shape are then
averaged with the wrong partner, and nothing notices. Hence one `CommStream` per group: a single
FIFO worker thread that runs every engine's collectives on that group in submission order.

What is guaranteed, and what is not:

* Every collective submitted to a group's stream runs after every one submitted before it, on one
  thread, so a rank's issue order is exactly its submission order: no thread race between engines.
* Submission order is the order in which each rank's code reaches its submissions. Hooks of one
  backward fire in the autograd engine's order, which is the same on every rank for the same
  graph, and each reducer launches its own buckets strictly in bucket order. So the same program
  on every rank pairs correctly.
* If the submission order differs across ranks (two losses backwarded in a different order per
  rank; data-dependent graphs that make two engines' buckets complete in a different order), the
  stream cannot reorder them without a cross-rank negotiation. Instead every collective carries a
  label (engine kind, the engine's ordinal on this group, bucket or item) in its descriptor, and
  tessera's descriptor check (on by default, `comm.set_checks`) compares it with the peer's:
  `CollectiveMismatch` names the rank and both sides ("DataParallel#0 item 0" against
  "DataParallel#1 item 0") instead of averaging the wrong buckets. With checks turned off a
  mismatch of equal shapes is not detected.
* Engine ordinals are handed out in construction order; constructing an engine is collective, so
  every rank of the group gives the same engine the same ordinal.
* Collectives issued outside the stream (the trainer's metrics, `dist.barrier`) are safe only while
  no stream work is queued on that group: every engine waits for its stream work before its
  `backward` or `step` returns, so between steps the streams are idle.

The worker is created at the first `stream_for(group)` and stopped by `close_streams()` (called by
`tessera.shutdown()` before the process group is destroyed) or at interpreter exit.
"""

from __future__ import annotations

import atexit
import itertools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from tessera.comm import diagnostics
from tessera.runtime.context import default_timeout_s, on_shutdown
from tessera.runtime.wait import wait_or_raise

__all__ = [
    "CommStream",
    "EngineTag",
    "close_streams",
    "existing_stream",
    "run_in_order",
    "stream_for",
]

_STOP = object()


@dataclass(frozen=True)
class EngineTag:
    """An engine registered on a stream: its kind and its ordinal among the group's engines."""

    kind: str
    ordinal: int

    def label(self, item: int = -1) -> int:
        """The descriptor word of this engine's collective `item` (a bucket index; -1: none)."""
        return diagnostics.encode_label(self.kind, self.ordinal, item)


class CommStream:
    """A FIFO worker thread that runs one group's collectives in submission order."""

    def __init__(self, group: dist.ProcessGroup | None, name: str) -> None:
        self.group = group
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._ordinals = itertools.count()
        self._closed = False
        self._thread = threading.Thread(target=self._work, name=f"tessera-stream-{name}")
        self._thread.daemon = True  # a rank that dies mid-collective must still exit
        self._thread.start()

    @property
    def closed(self) -> bool:
        """True once `close` ran: the stream accepts no more work."""
        return self._closed

    def register(self, kind: str) -> EngineTag:
        """Give an engine of `kind` its ordinal on this group (call in construction order)."""
        return EngineTag(kind, next(self._ordinals))

    def on_worker(self) -> bool:
        """Is the calling thread this stream's worker (a task submitting a nested collective)?"""
        return threading.current_thread() is self._thread

    def submit(self, fn: Callable[..., Any], *args: Any, label: int = 0) -> Future:
        """Queue `fn(*args)` behind every task already submitted; its result arrives in a Future.

        `label` (from `EngineTag.label`) travels in the descriptor of each collective `fn` issues.
        From the worker itself (a task that submits another) `fn` runs at once: queueing it would
        wait for the task that is waiting for it.
        """
        if self._closed:
            raise RuntimeError(f"the communication stream of group {self.name} is closed")
        future: Future = Future()
        if self.on_worker():
            _run_labeled(future, fn, args, label)
        else:
            self._queue.put((future, fn, args, label))
        return future

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        label: int = 0,
        what: str = "collective",
        timeout_s: float | None = None,
    ) -> Any:
        """`submit` and wait at most `timeout_s` (None: this rank's `Context.timeout_s`);
        re-raises `fn`'s error."""
        future = self.submit(fn, *args, label=label)
        return wait_or_raise(
            future,
            f"{what} on the communication stream of group {self.name}",
            default_timeout_s() if timeout_s is None else timeout_s,
            dist.get_rank() if dist.is_initialized() else 0,
            "another rank has not reached the same collective (or has failed)",
        )

    def close(self, timeout_s: float = 5.0) -> None:
        """Let the queued tasks finish and stop the worker (waits at most `timeout_s`)."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        if not self.on_worker():
            self._thread.join(timeout_s)

    def _work(self) -> None:
        while True:
            task = self._queue.get()
            if task is _STOP:
                return
            future, fn, args, label = task
            _run_labeled(future, fn, args, label)


def _run_labeled(future: Future, fn: Callable[..., Any], args: tuple, label: int) -> None:
    if not future.set_running_or_notify_cancel():
        return
    previous = diagnostics.set_label(label)
    try:
        result = fn(*args)
    except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread, which re-raises
        future.set_exception(exc)
    else:
        future.set_result(result)
    finally:
        diagnostics.set_label(previous)


_streams: dict[object, CommStream] = {}
_streams_lock = threading.Lock()


def _key(group: dist.ProcessGroup | None) -> object:
    # None and the world group are one group: they must share one stream.
    return dist.group.WORLD if group is None else group


def stream_for(group: dist.ProcessGroup | None = None) -> CommStream:
    """The communication stream of `group` (None: the world group), created at first use."""
    if not dist.is_initialized():
        raise RuntimeError("a communication stream needs a process group: call tessera.init()")
    key = _key(group)
    with _streams_lock:
        stream = _streams.get(key)
        if stream is None or stream.closed:
            ranks = "-".join(map(str, dist.get_process_group_ranks(key)))
            stream = CommStream(group, getattr(key, "group_name", "") or ranks)
            _streams[key] = stream
        return stream


def existing_stream(group: dist.ProcessGroup | None = None) -> CommStream | None:
    """The stream of `group` if an engine created one (callers without one may run inline)."""
    if not dist.is_initialized():
        return None
    stream = _streams.get(_key(group))
    return None if stream is None or stream.closed else stream


def run_in_order(group: dist.ProcessGroup | None, fn: Callable[..., Any], *args: Any) -> Any:
    """Run `fn(*args)` behind the group's queued collectives if it has a stream, else inline.

    For collectives issued from the main thread (tensor parallelism inside forward and backward):
    without an engine on the group there is nothing to order against and no thread hop is paid.
    """
    stream = existing_stream(group)
    if stream is None or stream.on_worker():
        return fn(*args)
    return stream.run(fn, *args, what=getattr(fn, "__name__", "collective"))


def close_streams() -> None:
    """Stop every stream's worker (before the process group is destroyed, and at exit)."""
    with _streams_lock:
        streams = list(_streams.values())
        _streams.clear()
    for stream in streams:
        stream.close()


atexit.register(close_streams)
on_shutdown(close_streams)  # before the process group they use is destroyed
