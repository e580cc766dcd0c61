"""ZeRO checkpoints of state that lives in files (offload="nvme"), moved chunk by chunk.

`NVMeAdam` keeps the moments, and the fp32 masters where they are a copy, in files, and trains
within `nvme_buffer_mb` of memory. A checkpoint must not undo that by reading a whole shard into
memory: here a save sees those tensors as `FileRun`s, which `_safetensors.write_tensors` writes
chunk by chunk through the optimizer's own staging buffer (`NVMeAdam.iter_range`), and a load
writes each run of the checkpoint into the files through `FileSink`s, chunk by chunk
(`NVMeAdam.write_range`). For an in-memory optimizer these helpers step aside (`streams`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "MOMENTS", "FileRun", "FileSink", "file_sinks", "inner_state", "master_source", "run_of",
    "streams",
]  # fmt: skip

MOMENTS = ("exp_avg", "exp_avg_sq")
"""The element-wise state `NVMeAdam` keeps in files (the moments of Adam)."""


class FileRun:
    """Elements [start, end) of one file of an `NVMeAdam` (a master or a moment of one flat):
    written into the checkpoint chunk by chunk through the optimizer's staging buffer, so a
    save under offload='nvme' holds one chunk of it, never the shard (`_safetensors.Streamed`).
    """

    dtype = torch.float32

    def __init__(self, inner: Any, kind: str, master: torch.Tensor, start: int, end: int) -> None:
        self.inner, self.kind, self.master = inner, kind, master
        self.start, self.end = start, end
        self.shape = torch.Size([end - start])

    def sub(self, start: int, end: int) -> FileRun:
        """Elements [start, end) of this run."""
        return FileRun(self.inner, self.kind, self.master, self.start + start, self.start + end)

    def chunks(self) -> Iterator[torch.Tensor]:
        """The elements, one staging buffer's worth at a time."""
        return self.inner.iter_range(self.kind, self.master, self.start, self.end)


def streams(inner: Any) -> bool:
    """The inner optimizer keeps state in files and moves ranges of it in chunks (NVMeAdam)."""
    return hasattr(inner, "iter_range") and hasattr(inner, "write_range")


def master_source(optimizer: Any, flat: Any) -> torch.Tensor | FileRun:
    """This rank's master slice of `flat`: in memory, or a run of the inner optimizer's file."""
    if optimizer.swapped_masters and streams(optimizer.optimizer):
        return FileRun(optimizer.optimizer, "param", flat.master, 0, flat.master.numel())
    return optimizer.master_value(flat)


def run_of(source: torch.Tensor | FileRun, start: int, end: int) -> torch.Tensor | FileRun:
    """Elements [start, end) of a source, as the fp32 tensor or file run the shard file gets."""
    if isinstance(source, FileRun):
        return source.sub(start, end)
    return source[start:end].detach().float()


def inner_state(inner: Any, master: torch.Tensor) -> dict[str, Any]:
    """The inner optimizer's state of one master; under offload='nvme' the moments are runs of
    its files (`FileRun`), streamed into the checkpoint."""
    if streams(inner):
        state = inner.state.get(master, {})
        if "step" not in state:
            return {}
        runs = {kind: FileRun(inner, kind, master, 0, master.numel()) for kind in MOMENTS}
        return {"step": state["step"], **runs}
    return inner.state.get(master, {})


class FileSink:
    """Where a loaded kind of one flat goes under offload='nvme': the inner optimizer's file,
    written chunk by chunk (and, for a master, the compute copy forward reads, `target`)."""

    def __init__(self, inner: Any, kind: str, master: torch.Tensor, target: Any) -> None:
        self.inner, self.kind, self.master, self.target = inner, kind, master, target
        self.chunk = inner.chunk

    def clear(self) -> None:
        """Zeros everywhere (what no run covers is padding: zero in every kind)."""
        self.inner.fill_zeros(self.kind, self.master)
        if self.target is not None:
            self.target.zero_()

    def write(self, begin: int, values: torch.Tensor) -> None:
        """`values` at elements [begin, begin + numel) of this rank's slice."""
        self.inner.write_range(self.kind, self.master, begin, values)
        if self.target is not None:
            self.target[begin : begin + values.numel()].copy_(values)


def file_sinks(optimizer: Any, saved_states: list[dict[str, Any]]) -> list[dict[str, FileSink]]:
    """Per flat, the kinds loaded straight into the inner optimizer's files (offload='nvme'):
    the master if it lives there, and the moments saved; none for an in-memory optimizer."""
    inner = optimizer.optimizer
    if not streams(inner):
        return [{} for _ in optimizer.flats]
    sinks = []
    for flat, saved in zip(optimizer.flats, saved_states):
        mine = {k: FileSink(inner, k, flat.master, None) for k in saved["kinds"] if k in MOMENTS}
        if optimizer.swapped_masters:
            mine["param"] = FileSink(
                inner, "param", flat.master, optimizer.layout.publish_target(flat)
            )
        sinks.append(mine)
    return sinks
