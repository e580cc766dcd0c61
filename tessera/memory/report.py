"""`report(model, optimizer)`: bytes of training state per category and per place.

Training memory has four parts (Rajbhandari et al. 2020, section 3): parameters, gradients,
optimizer state (Adam: two moments and a step per parameter), and activations saved for
backward. Offloading (ZeRO-Offload, ZeRO-Infinity) moves some of them from the device to host
memory or to files, so a useful report says where each byte is: `device` (an accelerator),
`host` (CPU memory) or `disk` (files under the paths given).

Bytes are counted from tensor storages, each storage once across all categories (a view of a
flat buffer is not counted twice; a tied weight is one parameter), so the report is what is
allocated, not an estimate. Activations are measured, not guessed: `saved_activation_bytes(fn)`
runs `fn` (a forward and loss) and counts the distinct storages autograd saves for backward,
which is the activation peak of a forward-then-backward step (backward only frees them). A
checkpointed block's recomputed inside is not saved, and is rightly not counted; the input the
checkpoint keeps is held by the checkpoint itself, outside autograd's saves, and is not counted.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tessera.memory.storage import PLACES, storage_bytes_by_place, storage_id

__all__ = ["MemoryReport", "report", "saved_activation_bytes"]

CATEGORIES = ("params", "grads", "optimizer state", "activations peak")


def _disk_bytes(paths: Iterable[str | os.PathLike[str]]) -> int:
    total = 0
    for path in map(Path, paths):
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        total += sum(f.stat().st_size for f in files)
    return total


def saved_activation_bytes(
    forward: Callable[[], Any], *, exclude: Iterable[torch.Tensor] = ()
) -> tuple[Any, dict[str, int]]:
    """Run `forward()`; return its result and the bytes per place autograd saved meanwhile.

    Storages of `exclude` (pass the model's parameters: a Linear saves its weight for backward,
    which is a parameter, not an activation) are not counted.
    """
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)  # autograd keeps it until backward anyway
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = forward()
    return result, storage_bytes_by_place(saved, {storage_id(t) for t in exclude})


@dataclass
class MemoryReport:
    """Bytes per category (`CATEGORIES`) and place (`PLACES`)."""

    bytes: dict[str, dict[str, int]] = field(default_factory=dict)

    def total(self, place: str | None = None) -> int:
        """All bytes at `place` (None: everywhere)."""
        return sum(
            count
            for by_place in self.bytes.values()
            for where, count in by_place.items()
            if place is None or where == place
        )

    def table(self) -> str:
        """A Markdown table, MiB per category and place."""
        lines = ["| category | " + " | ".join(PLACES) + " |", "|---" + "|---:" * len(PLACES) + "|"]
        for category, by_place in [*self.bytes.items(), ("total", None)]:
            cells = [
                self.total(place) if by_place is None else by_place.get(place, 0)
                for place in PLACES
            ]
            lines.append(
                f"| {category} | " + " | ".join(f"{c / 2**20:.2f} MiB" for c in cells) + " |"
            )
        return "\n".join(lines)


def _optimizer_tensors(optimizer: Any) -> list[torch.Tensor]:
    state = getattr(optimizer, "state", {})
    return [
        value
        for per_param in state.values()
        if isinstance(per_param, dict)
        for value in per_param.values()
        if isinstance(value, torch.Tensor)
    ]


def report(
    model: nn.Module,
    optimizer: Any = None,
    *,
    activations: dict[str, int] | None = None,
    disk_paths: Iterable[str | os.PathLike[str]] = (),
) -> MemoryReport:
    """Bytes of `model`'s params and grads, `optimizer`'s state, and optionally activations.

    `activations`: the per-place figure of `saved_activation_bytes(step_forward,
    exclude=model.parameters())`. `disk_paths`: files or
    directories holding offloaded state (their total size is the optimizer state on disk).
    """
    seen: set[tuple[str, int]] = set()
    params = list(model.parameters())
    result = MemoryReport()
    result.bytes["params"] = storage_bytes_by_place(params, seen)
    result.bytes["grads"] = storage_bytes_by_place((p.grad for p in params), seen)
    result.bytes["optimizer state"] = storage_bytes_by_place(
        _optimizer_tensors(optimizer) if optimizer is not None else [], seen
    )
    result.bytes["optimizer state"]["disk"] = _disk_bytes(disk_paths)
    if activations is not None:
        unknown = set(activations) - set(PLACES)
        if unknown:
            raise ValueError(f"activations has unknown places {sorted(unknown)}; use {PLACES}")
        result.bytes["activations peak"] = {**dict.fromkeys(PLACES, 0), **activations}
    return result
