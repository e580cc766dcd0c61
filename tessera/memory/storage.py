"""The one storage counter: bytes allocated behind tensors, each storage counted once.

Memory is held by storages, not tensors: the views of a flat buffer (ZeRO's flat parameters, a
swapped block's parameters), a tied weight, a gradient bucket share one. Counting `numel *
element_size` per tensor counts them again, and counts a storage ZeRO-3 freed (resized to zero
bytes) as if it were there. ZeRO's `measure_memory` and the memory `report` both count here.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["PLACES", "place", "storage_bytes", "storage_bytes_by_place", "storage_id"]

PLACES = ("device", "host", "disk")
"""Where bytes live: an accelerator, host memory, files."""


def place(tensor: torch.Tensor) -> str:
    """ "host" for a CPU tensor, else "device" (files are counted from their paths)."""
    return "host" if tensor.device.type == "cpu" else "device"


def storage_id(tensor: torch.Tensor) -> tuple[str, int]:
    """A storage's identity, shared by all its views: its device and address (two devices may
    use the same address)."""
    return (str(tensor.device), tensor.untyped_storage().data_ptr())


def storage_bytes_by_place(
    tensors: Iterable[torch.Tensor | None], seen: set[tuple[str, int]]
) -> dict[str, int]:
    """Bytes per place of the storages behind `tensors` not yet in `seen` (which it extends).

    A storage is known by `storage_id`; an empty one (freed in place by `resize_(0)`) counts
    zero. None entries (absent gradients) are skipped.
    """
    found = dict.fromkeys(PLACES, 0)
    for tensor in tensors:
        if tensor is None:
            continue
        storage = tensor.untyped_storage()
        key = storage_id(tensor)
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        found[place(tensor)] += storage.nbytes()
    return found


def storage_bytes(tensors: Iterable[torch.Tensor | None], seen: set[tuple[str, int]]) -> int:
    """Bytes of the distinct storages behind `tensors` not in `seen` (which it extends)."""
    return sum(storage_bytes_by_place(tensors, seen).values())
