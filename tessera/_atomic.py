"""Atomic file writes: a reader sees the old file or the new one, never half of either.

The bytes go to a temporary file in the same folder, which is fsync'ed and then renamed over the
target (a rename within one file system is atomic on POSIX); the folder is fsync'ed too, so the
rename itself survives a crash. Checkpoints of every strategy are written through here.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["write_atomically"]


def write_atomically(path: str | Path, fill: Callable[[BinaryIO], None]) -> Path:
    """Write `path` through `fill(file)`: a temporary file, fsync'ed, renamed over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as tmp:
            fill(tmp)
            tmp.flush()
            os.fsync(tmp.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a crash
    finally:
        os.close(dir_fd)
    return path
