"""Atomic checkpoint files that `torch.load` reads as they are.

A file is a plain `torch.save` of a dict of tensors and plain data: `torch.load(path,
weights_only=False)` (or `True`) opens it without tessera. Its integrity is the checkpoint
folder's business: `manifest.json` holds the size and SHA-256 of every file, verified before a
checkpoint is used (`tessera.checkpoint.series`).

Writing goes to a temporary file in the same folder, is fsync'ed, then renamed over the old file
(a rename within one file system is atomic on POSIX), and the folder is fsync'ed so the rename
itself survives a crash. Reading loads with `weights_only=True`, so a file cannot run code.

Files of older tessera versions start with a header (an 8-byte magic, the payload's SHA-256 and
length); they are still read, their checksum verified.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any, BinaryIO

import torch

from tessera.checkpoint.atomic import write_atomically
from tessera.errors import CheckpointError

__all__ = ["load_checkpoint", "save_checkpoint"]

_MAGIC = b"TSRACKP1"
"""Start of the headed files older versions wrote: magic, SHA-256 (32 bytes), length (8)."""
_HEADER = len(_MAGIC) + 32 + 8


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> Path:
    """Write `state` to `path` atomically as a plain `torch.save` file; return the path."""
    buffer = io.BytesIO()
    torch.save(state, buffer)  # serialise first: an unpicklable state leaves no file behind
    payload = buffer.getvalue()

    def fill(file: BinaryIO) -> None:
        file.write(payload)

    return write_atomically(path, fill)


def _headed_payload(path: Path, data: bytes) -> bytes:
    """The payload of an old headed file, after checking its length and checksum."""
    if len(data) < _HEADER:
        raise CheckpointError(f"{path} is truncated: its header is incomplete")
    digest = data[len(_MAGIC) : len(_MAGIC) + 32]
    length = int.from_bytes(data[len(_MAGIC) + 32 : _HEADER], "little")
    payload = data[_HEADER:]
    if len(payload) != length:
        raise CheckpointError(
            f"{path} is truncated: {len(payload)} of {length} payload bytes present"
        )
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointError(f"{path} is corrupt: checksum mismatch")
    return payload


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint written by `save_checkpoint` (or an older headed one)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    data = path.read_bytes()
    if data.startswith(_MAGIC):
        data = _headed_payload(path, data)
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # truncated, corrupt or not a torch.save file at all
        raise CheckpointError(
            f"{path} is not a readable checkpoint (truncated, corrupt or foreign): {exc}"
        ) from exc
