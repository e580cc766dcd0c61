"""Who waits for whom: each rank posts, through the process group's store, the point it reached.

A blocking wait marks itself (`waiting` / `done_waiting`); a watchdog thread notices a wait that
lasts longer than a moment and posts "rank r reached #s of `key`" to the store, so that the rank
whose deadline passes can read the posts and name the ranks that never arrived
(`missing_ranks`). `post_progress` is also called directly at points every rank passes (the
flight recorder's `reached`). Best effort throughout: without a store nothing is posted, and a
failing store never masks the timeout being reported.
"""

from __future__ import annotations

import threading
import time

import torch.distributed as dist

__all__ = ["current_wait", "done_waiting", "missing_ranks", "post_progress", "waiting"]


class _Watchdog:
    """Posts to the store which collective this rank has been waiting in for a while."""

    def __init__(self) -> None:
        self._waiting: tuple[str, int, float, float] | None = None  # key, seq, since, patience
        self._posted: tuple[str, int] | None = None
        self._thread: threading.Thread | None = None

    def begin(self, key: str, seq: int, timeout_s: float) -> None:
        # Called on every wait: two attribute writes, nothing more, on the fast path.
        self._waiting = (key, seq, time.monotonic(), min(1.0, timeout_s / 4))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tessera-progress-watchdog")
            self._thread.daemon = True
            self._thread.start()

    def end(self) -> None:
        self._waiting = None

    def _run(self) -> None:
        while True:
            time.sleep(0.1)
            waiting = self._waiting
            if waiting is None:
                continue
            key, seq, since, patience = waiting
            if time.monotonic() - since > patience and self._posted != (key, seq):
                self._posted = (key, seq)
                post_progress(key, seq)


_watchdog = _Watchdog()


def waiting(key: str, seq: int, timeout_s: float) -> None:
    """Mark the start of a blocking wait in collective `seq` of the group `key`."""
    _watchdog.begin(key, seq, timeout_s)


def done_waiting() -> None:
    """Mark the end of a blocking wait."""
    _watchdog.end()


def current_wait() -> dict[str, object] | None:
    """The collective this rank is blocked in right now (group key, seq, seconds), if any."""
    waiting = _watchdog._waiting
    if waiting is None:
        return None
    key, seq, since, _ = waiting
    return {"group": key, "seq": seq, "waited_s": round(time.monotonic() - since, 3)}


def _store() -> dist.Store | None:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store, no cross-rank diagnosis; the error still names us
        return None


def post_progress(key: str, seq: int) -> None:
    """Tell the other ranks, through the store, that this rank reached collective `seq`."""
    store = _store()
    if store is not None:
        try:
            store.set(f"tessera/comm/{key}/{dist.get_rank()}", str(seq))
        except Exception:  # noqa: BLE001 - best effort: diagnosis must never mask the timeout
            pass


def missing_ranks(key: str, seq: int, ranks: tuple[int, ...]) -> list[int] | None:
    """Global ranks of the group that have not been seen at collective `seq` (None: unknown)."""
    store = _store()
    if store is None:
        return None
    missing = []
    try:
        for rank in ranks:
            name = f"tessera/comm/{key}/{rank}"
            if rank == dist.get_rank():
                continue
            if not store.check([name]) or int(store.get(name).decode()) < seq:
                missing.append(rank)
    except Exception:  # noqa: BLE001
        return None
    return missing
