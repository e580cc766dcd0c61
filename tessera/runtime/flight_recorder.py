"""Flight-recorder dumps: when a job hangs, every rank says what it last did and whom it waited for.

A hang is diagnosed from all ranks at once: the ranks that time out know which collective they
were in and which peer never answered; the rank that stopped knows where it stopped. So when a
collective times out, the rank writes `DIR/hang-rank-N.json`:

    {"rank", "world_size", "pid", "time", "reason",
     "waiting": {"group", "seq", "op", "peer", "missing_ranks"} or null,
     "collectives": [{"seq", "kind", "algorithm", "op", "shape", "dtype", "group_ranks",
                      "call_site", "issued_by"}, ...],   # the last HISTORY, oldest first
     "stacks": {"thread name": "formatted Python stack", ...}}

Who writes it:
- tessera's own collectives (every algorithm, shm, and "native" gloo through `tessera.comm`,
  which registers its history here: `record_collectives_from`) at their timeout: the error
  they raise is built here (`timeout_error`, `timeout_with_record`), after the record is
  written, so the error can name the record's path;
- any rank on SIGTERM or SIGUSR1 (`install_signal_dump`; the launcher and torchrun send SIGTERM
  before SIGKILL), even one stuck inside a native wait (a gloo collective, a futex) that never
  gives the main thread back to Python: a watcher thread, woken through the signal module's
  wakeup fd, writes the record while the main thread stays where it is stuck;
- code calling `torch.distributed` directly (gloo's own timeout raises a RuntimeError):
  inside `dump_on_failure()`, which the trainer wraps around its loop; with `reached(label)`
  at points every rank passes, that timeout becomes a CollectiveTimeout naming the ranks that
  never reached this rank's last point.

DIR is `set_dump_dir(path)`, else the environment variable TESSERA_DUMP_DIR (the trainer sets
both to the run folder, so its ranks inherit it); with neither, nothing is written: a library
call must not litter the current folder.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tessera.errors import CollectiveMismatch, CollectiveTimeout
from tessera.runtime.progress import current_wait, missing_ranks, post_progress

__all__ = [
    "DUMP_DIR_ENV",
    "dump",
    "dump_dir",
    "dump_on_failure",
    "install_signal_dump",
    "reached",
    "set_dump_dir",
]

DUMP_DIR_ENV = "TESSERA_DUMP_DIR"
_dump_dir: Path | None = None


def set_dump_dir(path: str | Path | None) -> None:
    """Write flight records into `path` from now on (None: back to TESSERA_DUMP_DIR).

    Also exported as TESSERA_DUMP_DIR, so processes this one starts write there too.
    """
    global _dump_dir
    _dump_dir = None if path is None else Path(path)
    if path is None:
        os.environ.pop(DUMP_DIR_ENV, None)
    else:
        os.environ[DUMP_DIR_ENV] = str(path)


def dump_dir() -> Path | None:
    """Where flight records go, or None when dumping is off."""
    if _dump_dir is not None:
        return _dump_dir
    value = os.environ.get(DUMP_DIR_ENV, "")
    return Path(value) if value else None


def _rank() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


_collective_sources: list[Callable[[], list[dict[str, Any]]]] = []
"""Functions returning the collectives this rank called (tessera.comm registers its history)."""


def record_collectives_from(source: Callable[[], list[dict[str, Any]]]) -> None:
    """Put what `source()` returns (one dict per collective, oldest first) into every record.

    The recorder lives below the communication library and imports none of it: `tessera.comm`
    registers its history here when it is imported.
    """
    if source not in _collective_sources:
        _collective_sources.append(source)


def _collectives() -> list[dict[str, Any]]:
    return [row for source in _collective_sources for row in source()]


def _stacks() -> dict[str, str]:
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    return {
        f"{names.get(ident, 'thread')} ({ident})": "".join(traceback.format_stack(frame))
        for ident, frame in sys._current_frames().items()
    }


_written: set[Path] = set()
"""Records this process wrote: a later, vaguer one (its own SIGTERM) must not replace them."""
_dump_lock = threading.RLock()
"""One record written at a time (the signal watcher and the main thread may both dump);
re-entrant, as a signal handler may interrupt the main thread inside `dump`."""


def dump(
    reason: str, waiting: dict[str, Any] | None = None, *, replace: bool = True
) -> Path | None:
    """Write this rank's flight record (see the module docstring); return its path, or None.

    `waiting` describes the wait that failed, if any: group key, sequence number, operation,
    the peer waited for and the ranks that never arrived. `replace=False` keeps a record this
    process wrote already (the one of the timeout itself is the most precise). Never raises: a
    diagnosis must not replace the error it explains.
    """
    folder = dump_dir()
    if folder is None:
        return None
    with _dump_lock:
        return _dump(folder, reason, waiting, replace)


def _dump(folder: Path, reason: str, waiting: dict[str, Any] | None, replace: bool) -> Path | None:
    rank, world_size = _rank()
    path = folder / f"hang-rank-{rank}.json"
    if not replace and path in _written:
        return path
    try:
        record = {
            "rank": rank,
            "world_size": world_size,
            "pid": os.getpid(),
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "reason": reason,
            "waiting": waiting if waiting is not None else current_wait(),
            "collectives": _collectives(),
            "stacks": _stacks(),
        }
        folder.mkdir(parents=True, exist_ok=True)
        temporary = folder / f".hang-rank-{rank}.json.tmp"
        temporary.write_text(json.dumps(record, indent=1))
        temporary.replace(path)  # a reader never sees half a record
        _written.add(path)
        return path
    except Exception:  # noqa: BLE001 - best effort, see the docstring
        return None


def timeout_error(
    key: str, seq: int, ranks: tuple[int, ...], op: str, timeout_s: float, peer: int | None
) -> CollectiveTimeout:
    """Build the `CollectiveTimeout` of this rank, naming the peer and the ranks not arrived."""
    post_progress(key, seq)
    time.sleep(0.2)  # let the other waiting ranks' watchdogs post too
    detail = f"collective #{seq}"
    if peer is not None:
        detail += f", waiting for rank {peer}"
    missing = missing_ranks(key, seq, ranks)
    if missing:
        detail += f"; ranks {missing} have not reached collective #{seq} (never called it?)"
    elif missing is not None:
        detail += "; every rank reached it: a peer may have died or the network stalled"
    waited = {"group": key, "seq": seq, "op": op, "peer": peer, "missing_ranks": missing}
    return timeout_with_record(dist.get_rank(), op, timeout_s, detail, waited)


def timeout_with_record(
    rank: int, op: str, timeout_s: float, detail: str, waiting: dict[str, object]
) -> CollectiveTimeout:
    """A `CollectiveTimeout`, after this rank's flight record is written (if dumping is on).

    The error names the record's path and carries it as `flight_record`.
    """
    path = dump(f"timeout: {op} did not complete within {timeout_s:g} s; {detail}", waiting)
    if path is not None:
        detail += f" (flight record: {path})"
    error = CollectiveTimeout(rank, op, timeout_s, detail)
    error.flight_record = str(path) if path is not None else None
    return error


@contextlib.contextmanager
def dump_on_failure(folder: str | Path | None = None) -> Iterator[None]:
    """Dump the flight record if the body fails in communication; with `folder`, dump there.

    For failures tessera's collectives do not see: gloo's own timeout or a broken connection in
    a direct `torch.distributed` call (RuntimeError), a mismatch, a timeout of a wait outside
    tessera.comm. Other errors (a bad checkpoint, a wrong shape) say enough themselves. A record
    the failing collective wrote already is kept. The previous dump folder is restored after.
    """
    previous = (_dump_dir, os.environ.get(DUMP_DIR_ENV))
    if folder is not None:
        set_dump_dir(folder)
    try:
        try:
            yield
        except RuntimeError as exc:
            named = _name_the_stopped_ranks(exc)
            if named is None:
                raise
            raise named from exc
    except (TimeoutError, RuntimeError, CollectiveMismatch) as exc:
        dump(f"{type(exc).__name__}: {exc}", replace=False)
        raise
    finally:
        if folder is not None:
            _restore_dump_dir(*previous)


def _restore_dump_dir(folder: Path | None, env: str | None) -> None:
    global _dump_dir
    _dump_dir = folder
    if env is None:
        os.environ.pop(DUMP_DIR_ENV, None)
    else:
        os.environ[DUMP_DIR_ENV] = env


_SYNC_KEY = "sync-points"
_sync = {"count": 0, "label": ""}


def reached(label: str) -> None:
    """Mark a point every rank passes in the same order (a step, a checkpoint's barrier).

    Posted to the store, as the collectives' watchdog posts their progress: when a direct
    `torch.distributed` call then times out inside `dump_on_failure` (gloo's message names no
    rank), the error names the ranks that never reached this rank's last point.
    """
    _sync["count"] += 1
    _sync["label"] = label
    post_progress(_SYNC_KEY, _sync["count"])


def _name_the_stopped_ranks(exc: RuntimeError) -> CollectiveTimeout | None:
    """A CollectiveTimeout naming the ranks behind this one, for a timeout gloo raised."""
    text = str(exc).lower()
    if _sync["count"] == 0 or not ("timed out" in text or "timeout" in text):
        return None
    from tessera.runtime.context import default_timeout_s

    rank, world_size = _rank()
    behind = missing_ranks(_SYNC_KEY, _sync["count"], tuple(range(world_size)))
    if not behind:
        return None
    label = _sync["label"]
    error = CollectiveTimeout(
        rank,
        f"a torch.distributed call after {label!r}",
        default_timeout_s(),
        f"ranks {behind} have not reached {label!r} (stopped or hung?); gloo said: {exc}",
    )
    error.flight_record = None
    return error


_installed: dict[int, Any] = {}
"""The signals `install_signal_dump` handles, with the handler each had before."""
_watcher: dict[str, Any] = {}
"""The watcher thread and its pipe (keys thread, read, write), while one runs."""


def install_signal_dump(signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGUSR1)) -> None:
    """Dump the flight record when one of `signals` arrives (call from the main thread).

    SIGUSR1 dumps and goes on (ask a live process what it is doing); SIGTERM (any other signal
    given) dumps, then ends the process as it would have ended: through the handler that was
    there before, or, when that was the default action, by the signal itself.

    The record is written by a watcher thread that the signal wakes (`signal.set_wakeup_fd`:
    Python's C-level handler writes the signal's number to a pipe, whichever thread the kernel
    interrupted), so a rank whose main thread is stuck in a native wait (a gloo collective,
    a futex), where Python handlers never run, still writes it, with the stack it is stuck in,
    and still ends on SIGTERM. If the process already uses the wakeup fd (an asyncio loop), only
    the Python handler dumps, when the main thread next runs Python. A handler that was there
    before can only run in the main thread: a stuck process whose SIGTERM had one ends only if
    that handler runs.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    for number in signals:
        if number in _installed:
            continue
        _installed[number] = signal.signal(number, _on_signal)
    _start_watcher()


def _start_watcher() -> None:
    if _watcher:
        return
    read_fd, write_fd = os.pipe()  # close-on-exec: a program started by exec never holds it
    os.set_blocking(write_fd, False)  # the C-level handler must never block
    previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    if previous != -1:  # someone else's (an asyncio loop): theirs stays
        signal.set_wakeup_fd(previous)
        os.close(read_fd)
        os.close(write_fd)
        return
    thread = threading.Thread(
        target=_watch, args=(read_fd,), name="tessera-signal-dump", daemon=True
    )
    _watcher.update(thread=thread, read=read_fd, write=write_fd)
    thread.start()


def _forget_watcher_in_child() -> None:
    """After fork: the child has no watcher thread, and must not wake its parent's."""
    if not _watcher:
        return
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:  # not the main thread of the child: nothing was set there
        pass
    for key in ("read", "write"):
        os.close(_watcher[key])
    _watcher.clear()


os.register_at_fork(after_in_child=_forget_watcher_in_child)


def _watch(read_fd: int) -> None:
    """The watcher thread: for each signal number read from the wakeup pipe, dump (and end)."""
    while True:
        try:
            data = os.read(read_fd, 64)
        except OSError:
            return
        if not data:
            return
        for number in data:
            if number in _installed:  # not SIGINT and others Python also handles
                _answer(number)


def _reason(number: int) -> str:
    name = signal.Signals(number).name
    return f"signal {name}: stopped or asked from outside (it may be the rank that hung)"


def _answer(number: int) -> None:
    """Watcher side: write the record; for an ending signal, end the process if nobody will."""
    # SIGTERM also reaches ranks that failed first (the launcher stops them all): their own
    # timeout record says more, so it is kept. SIGUSR1 is a question: always answered.
    dump(_reason(number), replace=number == signal.SIGUSR1)
    if number == signal.SIGUSR1 or _installed.get(number) is not signal.SIG_DFL:
        return  # a previous Python handler runs in the main thread (`_on_signal`); SIG_IGN: none
    _die_by(number)


def _die_by(number: int) -> None:
    """End this process by signal `number`'s default action, from any thread.

    Python's `signal.signal` works only in the main thread, which may be stuck in native code;
    the C library's `signal` restores the default action from here, then the signal is sent
    again, so the process ends as it would have without a handler (its parent sees -number).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
    libc.signal(number, None)  # SIG_DFL is the null handler
    os.kill(os.getpid(), number)


def _on_signal(number: int, _frame: Any) -> None:
    """Main-thread side: runs only when the main thread executes Python again."""
    if number == signal.SIGUSR1:
        if not _watcher:  # with a watcher, the watcher answers
            dump(_reason(number), replace=True)
        return
    dump(_reason(number), replace=False)  # kept if the watcher wrote it already
    previous = _installed.pop(number, signal.SIG_DFL)
    signal.signal(number, previous)
    if callable(previous):
        previous(number, _frame)
    else:
        os.kill(os.getpid(), number)  # the default action: end the process
