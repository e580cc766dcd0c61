"""Atomic, checksummed checkpoint files: a run is never left with half a checkpoint.

Layout of a file: an 8-byte magic, the 32-byte SHA-256 of the payload, the payload's length as
8 bytes little-endian, then the payload (a `torch.save` of a dict of tensors and plain data).

Writing goes to a temporary file in the same folder, is fsync'ed, then renamed over the old file
(a rename within one file system is atomic on POSIX), and the folder is fsync'ed so the rename
itself survives a crash. Reading checks magic, length and checksum before unpickling anything, and
loads with `weights_only=True`, so a corrupt, truncated or foreign file is refused whole.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any, BinaryIO

import torch

from tessera._atomic import write_atomically
from tessera.errors import CheckpointError

__all__ = ["load_checkpoint", "save_checkpoint"]

_MAGIC = b"TSRACKP1"
_HEADER = len(_MAGIC) + 32 + 8


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> Path:
    """Write `state` to `path` atomically, with a checksum; return the path."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    header = _MAGIC + hashlib.sha256(payload).digest() + len(payload).to_bytes(8, "little")

    def fill(file: BinaryIO) -> None:
        file.write(header)
        file.write(payload)

    return write_atomically(path, fill)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint written by `save_checkpoint`, verifying it before anything is loaded."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    data = path.read_bytes()
    if len(data) < _HEADER or not data.startswith(_MAGIC):
        raise CheckpointError(f"{path} is not a tessera checkpoint (bad header)")
    digest = data[len(_MAGIC) : len(_MAGIC) + 32]
    length = int.from_bytes(data[len(_MAGIC) + 32 : _HEADER], "little")
    payload = data[_HEADER:]
    if len(payload) != length:
        raise CheckpointError(
            f"{path} is truncated: {len(payload)} of {length} payload bytes present"
        )
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointError(f"{path} is corrupt: checksum mismatch")
    try:
        return torch.load(io.BytesIO(payload), weights_only=True)
    except Exception as exc:  # the checksum held, so the writer itself stored something odd
        raise CheckpointError(f"{path} could not be unpickled: {exc}") from exc
