"""Files that hold training state outside memory: one private folder per run, removed at exit.

ZeRO-Infinity (Rajbhandari et al., SC 2021) keeps optimizer state, and optionally parameters, in
files on fast local disks ("NVMe"), and GeePS (Cui et al., EuroSys 2016) swaps idle parameters
out of the memory that computes. Both need scratch files that never outlive the run and that a
later run can never mistake for its own. So:

* every run writes into its own folder `tessera-swap-HOST-PID-RANDOM` under the directory the
  user names, with a `MANIFEST.json` (host, pid, process start time, purpose) written atomically
  when the folder is created; nothing is ever read from a file this process did not write;
* the folder is removed when its owner is closed, garbage-collected or the interpreter exits
  (`weakref.finalize`, and `multiprocessing`'s exit hook for spawned ranks);
* SIGTERM (what launchers send before SIGKILL) removes it too: a handler chained in front of
  the previous one (installed from the main thread, at the first folder);
* a run that died without cleaning up (`kill -9`) leaves a folder whose process is gone: the next
  `SwapFolder` under the same directory on the same host removes it, before it checks the free
  space (the dead run's files hold it), so a restart after a crash finds the room it had (other
  hosts' folders, on a shared file system, are left alone).

`SwapFile` reads and writes fixed ranges of one file with `pread`/`pwrite` (no Python-level
buffering, releases the GIL), through `O_DIRECT` where the file system supports it, so the bytes
really go to the disk and the page cache does not grow with the model; buffers and offsets are
then 4096-byte aligned, which `aligned_empty` and the callers' chunk sizes provide; where it does
not (tmpfs), buffered I/O with the same results.
"""

from __future__ import annotations

import ctypes
import json
import multiprocessing.util
import os
import shutil
import socket
import tempfile
import uuid
import weakref
from pathlib import Path

import torch

from tessera.runtime.signals import on_sigterm

__all__ = ["ALIGN", "SwapFile", "SwapFolder", "aligned_empty", "check_swap_dir"]

PREFIX = "tessera-swap-"
MANIFEST = "MANIFEST.json"
ALIGN = 4096
"""Byte alignment of O_DIRECT buffers, offsets and lengths (a disk's logical block, or more)."""


def check_swap_dir(
    path: str | os.PathLike[str] | None, need_bytes: int = 0, what: str = "nvme_dir"
) -> Path:
    """`path` as a Path if it is an existing, writable folder with `need_bytes` free; else raise.

    Called before anything is written, with the estimate of what will be, so a run that cannot
    fit stops at once with one message instead of after hours with ENOSPC.
    """
    if path is None:
        raise ValueError(f"{what} is required for offload='nvme' (a folder on a fast local disk)")
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"{what} {str(folder)!r} does not exist or is not a folder")
    try:  # a real file: permissions, read-only mounts and root's exemptions all show here
        probe, name = tempfile.mkstemp(dir=folder, prefix=".tessera-probe-")
        os.close(probe)
        os.unlink(name)
    except OSError as error:
        raise PermissionError(
            f"{what} {str(folder)!r} is not writable by this process ({error.strerror})"
        ) from None
    free = shutil.disk_usage(folder).free
    if need_bytes > free:
        raise OSError(
            f"{what} {str(folder)!r} has {free / 2**30:.2f} GiB free; the offloaded state needs "
            f"{need_bytes / 2**30:.2f} GiB"
        )
    return folder


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (tells a reused pid apart)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _alive(pid: int, started: str | None) -> bool:
    if pid == os.getpid():
        return True
    now = _start_time(pid)
    if now is None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return started is None  # no /proc here: trust the pid
    return started is None or now == started


def remove_stale(root: Path) -> list[Path]:
    """Remove the swap folders under `root` left by dead processes of this host; return them."""
    removed = []
    host = socket.gethostname()
    for folder in root.glob(f"{PREFIX}*"):
        try:
            manifest = json.loads((folder / MANIFEST).read_text())
            owner_host, pid, started = manifest["host"], int(manifest["pid"]), manifest["started"]
        except (OSError, ValueError, KeyError):
            # No manifest yet (its owner died creating it, or is creating it now): the name says
            # host and pid; a live owner keeps its folder.
            parts = folder.name[len(PREFIX) :].rsplit("-", 2)
            if len(parts) != 3 or not parts[1].isdigit():
                continue
            owner_host, pid, started = parts[0], int(parts[1]), None
        if owner_host == host and not _alive(pid, started):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


class SwapFolder:
    """This run's private folder of swap files under `root`; removed by `close()` or at exit."""

    def __init__(self, root: str | os.PathLike[str], *, purpose: str, need_bytes: int = 0) -> None:
        root = check_swap_dir(root)
        remove_stale(root)  # before the space check: a killed run's files hold the space
        check_swap_dir(root, need_bytes)
        pid = os.getpid()
        self.path = root / f"{PREFIX}{socket.gethostname()}-{pid}-{uuid.uuid4().hex[:12]}"
        self.path.mkdir()
        manifest = {
            "format": "tessera-swap/1",
            "host": socket.gethostname(),
            "pid": pid,
            "started": _start_time(pid),
            "purpose": purpose,
        }
        temporary = self.path / f".{MANIFEST}.tmp"
        temporary.write_text(json.dumps(manifest))
        os.replace(temporary, self.path / MANIFEST)
        self._files: list[SwapFile] = []
        self._finalizer = weakref.finalize(self, _remove, self.path, self._files)
        multiprocessing.util.Finalize(self, _remove, (self.path, self._files), exitpriority=10)
        _live_folders[self.path] = None
        _install_sigterm_cleanup()

    def file(self, name: str, nbytes: int, *, direct: bool = True) -> SwapFile:
        """A new file of `nbytes` (rounded up to `ALIGN`) in this folder, space reserved.

        `direct=False`: buffered I/O, for callers whose buffers cannot be aligned."""
        swap = SwapFile(self.path / name, nbytes, direct=direct)
        self._files.append(swap)
        return swap

    def close(self) -> None:
        """Close every file and remove the folder (idempotent)."""
        self._finalizer()


def _remove(path: Path, files: list[SwapFile]) -> None:
    for swap in files:
        swap.close()
    shutil.rmtree(path, ignore_errors=True)
    _live_folders.pop(path, None)


_live_folders: dict[Path, None] = {}
"""This process's swap folders not yet removed (what a SIGTERM removes)."""


def _remove_live_folders() -> None:
    """Remove this process's swap folders (on SIGTERM, `tessera.runtime.signals`).

    Only the names go (`rmtree`); the files stay open, so should the previous handler let the
    process go on, its swap files still work, and the kernel frees their space at exit.
    """
    for path in list(_live_folders):
        shutil.rmtree(path, ignore_errors=True)


def _install_sigterm_cleanup() -> None:
    """Remove the swap folders on SIGTERM, before the previous handler runs (idempotent)."""
    on_sigterm(_remove_live_folders)


def aligned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised 1-D tensor whose data starts on an `ALIGN`-byte boundary."""
    element = torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(numel * element + ALIGN, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip : skip + numel * element].view(dtype)


def _round_up(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class SwapFile:
    """One preallocated file read and written in aligned ranges (`O_DIRECT` if possible)."""

    def __init__(self, path: Path, nbytes: int, *, direct: bool = True) -> None:
        self.path = path
        self.nbytes = _round_up(nbytes)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
        self.direct = direct and hasattr(os, "O_DIRECT")
        if self.direct:
            try:
                self._fd = os.open(path, flags | os.O_DIRECT, 0o600)
            except FileExistsError:
                raise
            except OSError:  # tmpfs and some others refuse O_DIRECT: buffered I/O, same results
                self.direct = False
                # Linux creates the file before it refuses the flag (EINVAL from the file
                # system's open): remove it, or the buffered O_EXCL open below finds it there.
                # It did not exist before (else FileExistsError above): it is this call's.
                path.unlink(missing_ok=True)
        if not self.direct:
            self._fd = os.open(path, flags, 0o600)
        try:
            os.posix_fallocate(self._fd, 0, self.nbytes)  # ENOSPC now, not mid-training
        except OSError as error:
            os.close(self._fd)
            raise OSError(
                f"cannot reserve {self.nbytes} bytes for swap file {path}: {error}"
            ) from None

    def _check(self, offset: int, buffer: torch.Tensor) -> memoryview:
        length = buffer.numel() * buffer.element_size()
        if offset < 0 or offset + length > self.nbytes:
            raise ValueError(
                f"{self.path}: range [{offset}, {offset + length}) is outside the file's "
                f"{self.nbytes} bytes"
            )
        if self.direct and (offset % ALIGN or length % ALIGN or buffer.data_ptr() % ALIGN):
            raise ValueError(f"{self.path}: O_DIRECT needs {ALIGN}-byte aligned ranges")
        if not buffer.is_contiguous() or buffer.device.type != "cpu":
            raise ValueError(f"{self.path}: I/O needs a contiguous CPU tensor")
        # A view of the tensor's memory by address: not `.numpy()`, which would mark the storage
        # as not resizable for good (swap_idle frees storages by resizing them to zero bytes).
        return memoryview((ctypes.c_char * length).from_address(buffer.data_ptr())).cast("B")

    def read(self, offset: int, buffer: torch.Tensor) -> None:
        """Fill the contiguous `buffer` with the file's bytes from `offset`."""
        view, done = self._check(offset, buffer), 0
        while done < len(view):
            count = os.preadv(self._fd, [view[done:]], offset + done)
            if count <= 0:
                raise OSError(f"{self.path}: short read at byte {offset + done}")
            done += count

    def write(self, offset: int, buffer: torch.Tensor) -> None:
        """Write the contiguous `buffer` into the file at `offset`."""
        view, done = self._check(offset, buffer), 0
        while done < len(view):
            done += os.pwritev(self._fd, [view[done:]], offset + done)

    def close(self) -> None:
        """Close the file descriptor (idempotent; the folder's removal deletes the file)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
