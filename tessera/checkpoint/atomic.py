"""Atomic file writes: a reader sees the old file or the new one, never half of either.

The bytes go to a temporary file in the same folder, which is fsync'ed and then renamed over the
target (a rename within one file system is atomic on POSIX); the folder is fsync'ed too, so the
rename itself survives a crash. Checkpoints of every strategy are written through here, and
exports through `replace_atomically` (a file or a folder another library writes). Every file and
folder gets the mode a plain `open` / `mkdir` would give under the process's umask (0644 / 0755
under the usual 022), not the private 0600 / 0700 of `mkstemp` / `mkdtemp`: a checkpoint or an
export is shared as any other output is.

`pause_point` is a test hook at the moments a crash would hurt most (a file written but not yet
renamed, a shard folder complete but not yet committed): tests hold a real process there and
`kill -9` it, instead of editing bytes after the fact. `arm_write_crash` is the same idea for the
`checkpoint` fault of `tessera.train.faults`: the next write of this process dies half-way through.
"""

from __future__ import annotations

import fnmatch
import os
import secrets
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = [
    "arm_write_crash",
    "default_mode",
    "fsync_folder",
    "pause_point",
    "replace_atomically",
    "write_atomically",
]

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


_umask_lock = threading.Lock()


def _umask() -> int:
    """The process's umask, read without changing it where Linux says it (`/proc`)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    with _umask_lock:  # elsewhere: set and restore (another thread may not create files now)
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def default_mode(folder: bool = False) -> int:
    """The mode `open(path, "w")` (0666) or `mkdir` (0777) gives under the umask."""
    return (0o777 if folder else 0o666) & ~_umask()


def write_atomically(path: str | Path, fill: Callable[[BinaryIO], None]) -> Path:
    """Write `path` through `fill(file)`: a temporary file, fsync'ed, renamed over `path`.

    The file gets the mode a plain `open` would give (`default_mode`), not mkstemp's 0600."""
    global _write_crash
    claim, _write_crash = _write_crash, None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, default_mode())
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


def _settle_tree(root: Path) -> None:
    """Give every file under `root` (or `root` itself) and every folder the mode of a plain
    `open` / `mkdir` (safetensors' writer creates its file 0600), then fsync them."""
    files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fchmod(fd, default_mode())
            os.fsync(fd)
        finally:
            os.close(fd)
    if root.is_dir():
        for folder in [root, *(p for p in root.rglob("*") if p.is_dir())]:
            os.chmod(folder, default_mode(folder=True))
            fsync_folder(folder)


def replace_atomically(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Let `write(tmp)` create a file or a folder at `tmp`, then put it at `path` atomically.

    For what another library writes by name (`safetensors.save_file`, `save_pretrained`): `tmp`
    is a fresh name beside `path`; once `write` returns, everything under it is fsync'ed and
    renamed to `path`, so a process killed before holds no half file under the final name (only
    a hidden `.NAME.*.tmp` beside it, removed when `write` raises). A folder at `path` that
    exists already is updated file by file, each file replaced by a rename (its other files
    kept). Modes are those of a plain `open` / `mkdir` (`default_mode`).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        write(tmp)
        _settle_tree(tmp)
        pause_point(f"write:{path}")
        if tmp.is_dir() and path.is_dir():
            for file in sorted(p for p in tmp.rglob("*") if p.is_file()):
                target = path / file.relative_to(tmp)
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(file, target)
                fsync_folder(target.parent)
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, path)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise
    fsync_folder(path.parent)
    return path
