"""Micro-batches of any batch: every tensor of a (nested) tuple, list or dict split on dim 0.

A batch is a tensor, an `(inputs, targets)` pair, a Hugging Face style dict of tensors, or any
nesting of these; what is not a tensor (a flag, a string) goes unchanged into every micro-batch.
Every tensor must have the batch's rows on dim 0, so a micro-batch is the same rows of each.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["batch_rows", "microbatch_sizes", "split_rows", "take_rows"]


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, Mapping):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, (tuple, list)):
        return [t for v in tree for t in _tensors(v)]
    return []


def _map(tree: Any, fn: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, Mapping):
        return type(tree)({k: _map(v, fn) for k, v in tree.items()})  # type: ignore[call-arg]
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # a namedtuple
        return type(tree)(*(_map(v, fn) for v in tree))
    if isinstance(tree, (tuple, list)):
        return type(tree)(_map(v, fn) for v in tree)
    return tree


def batch_rows(batch: Any) -> int:
    """The batch's rows: dim 0 of its tensors (ValueError if they disagree or there is none)."""
    rows = {t.shape[0] if t.dim() else None for t in _tensors(batch)}
    if not rows or None in rows or len(rows) > 1:
        raise ValueError(
            f"every tensor of a batch needs the batch's rows on dim 0; found dim-0 sizes {rows}"
        )
    return rows.pop()


def microbatch_sizes(rows: int, num_microbatches: int) -> list[int]:
    """Rows of each of `num_microbatches` micro-batches (sizes differ by at most one)."""
    if num_microbatches > rows:
        raise ValueError(f"num_microbatches ({num_microbatches}) is larger than the batch ({rows})")
    return [len(c) for c in torch.arange(rows).tensor_split(num_microbatches)]


def split_rows(batch: Any, sizes: list[int]) -> list[Any]:
    """`batch` cut into consecutive micro-batches of `sizes` rows (same structure each)."""
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    return [take_rows(batch, start, start + size) for start, size in zip(starts, sizes)]


def take_rows(batch: Any, start: int, end: int) -> Any:
    """Rows `[start, end)` of every tensor of `batch`."""
    return _map(batch, lambda t: t[start:end])
