"""The safetensors file layout, written and read piece by piece without the safetensors package.

Layout (https://github.com/huggingface/safetensors): 8 bytes little-endian header length, a JSON
header `{key: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}` padded
with spaces to 8 bytes, then the raw little-endian tensor bytes, back to back in header order.
Because every offset is known from the header, a writer can lay the file out first and fill it
tensor by tensor, and a reader can fetch one tensor: memory stays bounded by the largest tensor;
or, for a tensor written as `Streamed` chunks and read with `TensorFile.get_range`, by a chunk.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import torch

from tessera.checkpoint.atomic import write_atomically

__all__ = ["Streamed", "TensorFile", "file_sha256", "layout", "tensor_bytes", "write_tensors"]

DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_BY_NAME = {name: dtype for dtype, name in DTYPES.items()}


def layout(
    entries: Iterable[tuple[str, torch.dtype, list[int]]], metadata: dict[str, str]
) -> tuple[bytes, dict[str, dict[str, Any]], int]:
    """(length prefix + padded JSON header, the header, total data bytes) for `entries`."""
    header: dict[str, Any] = {}
    offset = 0
    for key, dtype, shape in entries:
        nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        header[key] = {
            "dtype": DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    encoded = json.dumps({**header, "__metadata__": metadata}, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return len(encoded).to_bytes(8, "little") + encoded, header, offset


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The raw bytes of `tensor` (C order); a device tensor is copied to the host first (numpy
    reads host memory only)."""
    host = tensor.detach().to("cpu").contiguous().reshape(-1)
    return host.view(torch.uint8).numpy().tobytes()


class Streamed(Protocol):
    """A tensor written chunk by chunk (never whole in memory): its dtype, shape and chunks."""

    dtype: torch.dtype
    shape: torch.Size

    def chunks(self) -> Iterator[torch.Tensor]:
        """The elements in C order, in pieces, each written before the next is asked for."""
        ...


def write_tensors(path: Path, tensors: dict[str, torch.Tensor | Streamed]) -> str:
    """Write `tensors` as one safetensors file, atomically; return its SHA-256 (hex).

    A `Streamed` value goes in chunk by chunk: memory is one chunk, not the tensor."""
    prefix, _, _ = layout(((k, t.dtype, list(t.shape)) for k, t in tensors.items()), {})
    digest = hashlib.sha256()

    def pieces() -> Iterator[bytes]:
        yield prefix
        for tensor in tensors.values():
            if isinstance(tensor, torch.Tensor):
                yield tensor_bytes(tensor)
            else:
                yield from (tensor_bytes(chunk) for chunk in tensor.chunks())

    def fill(out: BinaryIO) -> None:
        for chunk in pieces():
            digest.update(chunk)
            out.write(chunk)

    write_atomically(path, fill)
    return digest.hexdigest()


def file_sha256(path: Path, chunk_bytes: int = 1 << 20) -> str:
    """SHA-256 of a file, read in chunks (constant memory)."""
    digest = hashlib.sha256()
    with path.open("rb") as source:
        while chunk := source.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


class TensorFile:
    """A safetensors file opened for reading one tensor at a time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = path.open("rb")
        length = int.from_bytes(self._file.read(8), "little")
        self.header = json.loads(self._file.read(length))
        self.header.pop("__metadata__", None)
        self._base = 8 + length

    def keys(self) -> list[str]:
        """Tensor names, in file order."""
        return list(self.header)

    def numel(self, key: str) -> int:
        """Elements of one tensor, from the header."""
        return int(torch.Size(self.header[key]["shape"]).numel())

    def dtype(self, key: str) -> torch.dtype:
        """dtype of one tensor, from the header."""
        return _BY_NAME[self.header[key]["dtype"]]

    def get(self, key: str) -> torch.Tensor:
        """Read one tensor."""
        entry = self.header[key]
        begin, end = entry["data_offsets"]
        dtype = _BY_NAME[entry["dtype"]]
        if end == begin:
            return torch.empty(entry["shape"], dtype=dtype)
        self._file.seek(self._base + begin)
        data = bytearray(self._file.read(end - begin))
        return torch.frombuffer(data, dtype=dtype).reshape(entry["shape"])

    def get_range(self, key: str, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of one tensor (flattened), read straight into a new tensor."""
        entry = self.header[key]
        dtype = _BY_NAME[entry["dtype"]]
        out = torch.empty(end - start, dtype=dtype)
        size = out.element_size()
        self._file.seek(self._base + entry["data_offsets"][0] + size * start)
        view = memoryview(out.view(torch.uint8).numpy()).cast("B")
        if self._file.readinto(view) != len(view):
            raise OSError(f"{self.path}: {key} is shorter than its header says")
        return out

    def close(self) -> None:
        """Close the file."""
        self._file.close()

    def __enter__(self) -> TensorFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
