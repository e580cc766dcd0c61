"""Atomic file writes: a reader sees the old file or the new one, never half of either.

The bytes go to a temporary file in the same folder, which is fsync'ed and then renamed over the
target (a rename within one file system is atomic on POSIX); the folder is fsync'ed too, so the
rename itself survives a crash. Checkpoints of every strategy are written through here.

`pause_point` is a test hook at the moments a crash would hurt most (a file written but not yet
renamed, a shard folder complete but not yet committed): tests hold a real process there and
`kill -9` it, instead of editing bytes after the fact. `arm_write_crash` is the same idea for the
`checkpoint` fault of `tessera.train.faults`: the next write of this process dies half-way through.
"""

from __future__ import annotations

import fnmatch
import os
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["arm_write_crash", "fsync_folder", "pause_point", "write_atomically"]

PAUSE_ENV = "TESSERA_TEST_PAUSE"
"""fnmatch pattern over pause labels (`write:PATH`, `commit:FOLDER`); unset in normal runs."""
PAUSE_SKIP_ENV = "TESSERA_TEST_PAUSE_SKIP"
"""How many matching moments to let pass before holding (default 0: hold at the first)."""
PAUSE_MARKER_ENV = "TESSERA_TEST_PAUSE_MARKER"
"""File created when a process holds, so the test knows when to kill it."""
PAUSE_LIMIT_S = 120.0
"""A held process that nobody kills gives up with an error instead of hanging."""

_matches_seen = 0
_write_crash: Callable[[], bool] | None = None


def arm_write_crash(claim: Callable[[], bool] | None) -> None:
    """Fault injection: the next `write_atomically` of this process dies in the middle of its file.

    Half of the first chunk the writer hands over reaches the disk (flushed and fsync'ed), then
    `claim()` is asked; if it returns True the process SIGKILLs itself there, before the rename;
    otherwise the write completes normally. `None` disarms.
    """
    global _write_crash
    _write_crash = claim


class _CrashMidway:
    """A file wrapper that lets half of the first chunk through, then asks whether to die."""

    def __init__(self, file: BinaryIO, claim: Callable[[], bool]) -> None:
        self._file = file
        self._claim = claim

    def write(self, data: bytes) -> int:
        if self._claim is not None:
            view = memoryview(data).cast("B")
            half = len(view) // 2
            self._file.write(view[:half])
            self._file.flush()
            os.fsync(self._file.fileno())
            claim, self._claim = self._claim, None
            if claim():
                os.kill(os.getpid(), signal.SIGKILL)
            self._file.write(view[half:])
            return len(view)
        return self._file.write(data)

    def __getattr__(self, name: str):  # tell, seek, fileno...: the real file's
        return getattr(self._file, name)


def pause_point(label: str) -> None:
    """Test hook: hold this process at `label` if `TESSERA_TEST_PAUSE` matches it."""
    global _matches_seen
    pattern = os.environ.get(PAUSE_ENV)
    if not pattern or not fnmatch.fnmatchcase(label, pattern):
        return
    _matches_seen += 1
    if _matches_seen <= int(os.environ.get(PAUSE_SKIP_ENV, "0")):
        return
    marker = os.environ.get(PAUSE_MARKER_ENV)
    if marker:
        Path(marker).write_text(f"{os.getpid()} {label}\n")
    time.sleep(PAUSE_LIMIT_S)
    raise RuntimeError(f"test pause at {label} was not ended by a kill within {PAUSE_LIMIT_S} s")


def fsync_folder(folder: str | Path) -> None:
    """fsync a folder, so that renames and creations inside it survive a crash."""
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_atomically(path: str | Path, fill: Callable[[BinaryIO], None]) -> Path:
    """Write `path` through `fill(file)`: a temporary file, fsync'ed, renamed over `path`."""
    global _write_crash
    claim, _write_crash = _write_crash, None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as tmp:
            fill(tmp if claim is None else _CrashMidway(tmp, claim))
            tmp.flush()
            pause_point(f"write:{path}")
            os.fsync(tmp.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    fsync_folder(path.parent)  # the rename itself survives a crash
    return path
