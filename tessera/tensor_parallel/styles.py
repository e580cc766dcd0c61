"""The styles of a tensor-parallel plan: which module types each splits, and how.

One table, `KINDS`: style -> the module types it takes, each with the weight dimension it splits,
the builder of its parallel layer and a check of the instance (run at planning, before any module
changes). `parallelize.py` matches a plan against it; a new splittable type is one entry here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist
from torch import nn

from tessera.tensor_parallel.layers import (
    ChannelParallelConv2d,
    ColumnParallelConv1D,
    ColumnParallelEmbedding,
    ColumnParallelLinear,
    RowParallelConv1D,
    RowParallelConv2d,
    RowParallelLinear,
    VocabParallelEmbedding,
    check_splittable_conv,
    is_hf_conv1d,
)

__all__ = ["KINDS", "STYLES", "Group", "Kind"]

STYLES = ("column", "row", "vocab", "column_gather", "embedding")
"""The styles a plan may name (what each does: `parallelize.py`'s docstring)."""

Group = dist.ProcessGroup | None
"""A process group, or None for the default (world) group."""


@dataclass(frozen=True)
class Kind:
    """One module type a style splits: how to recognise it, which weight dimension it splits,
    `build(module, group, paired, chunks)` (`paired`: a column conv whose output channels a
    row conv takes split; `chunks`: blocks of a fused projection), and `check(module, name)`,
    which raises ValueError for an instance the layer cannot reproduce (run before any change)."""

    name: str
    matches: Callable[[nn.Module], bool]
    dim: int
    build: Callable[[nn.Module, Group, bool, int], nn.Module]
    check: Callable[[nn.Module, str], None] = lambda module, name: None


def _check_embedding_columns(embedding: nn.Module, name: str) -> None:
    if embedding.max_norm is not None:
        raise ValueError(
            f"{name}: an Embedding with max_norm renormalises whole rows, which no rank holds "
            f"when split by columns"
        )


def _check_embedding_rows(embedding: nn.Module, name: str) -> None:
    if embedding.padding_idx is not None or embedding.max_norm is not None:
        raise ValueError(
            f"{name}: the vocabulary split takes no padding_idx and no max_norm (style "
            f"'embedding' keeps padding_idx)"
        )


def _is(cls: type) -> Callable[[nn.Module], bool]:
    return lambda module: type(module) is cls  # a subclass may override forward: not ours to split


_LINEAR_COLUMN = Kind(
    "Linear",
    _is(nn.Linear),
    0,
    lambda m, g, _, c: ColumnParallelLinear.from_dense(m, group=g, chunks=c),
)
_CONV1D_COLUMN = Kind(
    "Conv1D",
    is_hf_conv1d,
    1,
    lambda m, g, _, c: ColumnParallelConv1D.from_dense(m, group=g, chunks=c),
)
KINDS: dict[str, tuple[Kind, ...]] = {
    "column": (
        _LINEAR_COLUMN,
        _CONV1D_COLUMN,
        Kind(
            "Conv2d",
            _is(nn.Conv2d),
            0,
            lambda m, g, paired, _: ChannelParallelConv2d.from_dense(
                m, group=g, gather_output=not paired
            ),
            check_splittable_conv,
        ),
    ),
    "column_gather": (
        Kind(
            "Linear",
            _is(nn.Linear),
            0,
            lambda m, g, _, c: ColumnParallelLinear.from_dense(m, group=g, gather_output=True),
        ),
        Kind(
            "Conv1D",
            is_hf_conv1d,
            1,
            lambda m, g, _, c: ColumnParallelConv1D.from_dense(m, group=g, gather_output=True),
        ),
    ),
    "row": (
        Kind(
            "Linear", _is(nn.Linear), 1, lambda m, g, _, c: RowParallelLinear.from_dense(m, group=g)
        ),
        Kind(
            "Conv1D", is_hf_conv1d, 0, lambda m, g, _, c: RowParallelConv1D.from_dense(m, group=g)
        ),
        Kind(
            "Conv2d",
            _is(nn.Conv2d),
            1,
            lambda m, g, _, c: RowParallelConv2d.from_dense(m, group=g),
            check_splittable_conv,
        ),
    ),
    "embedding": (
        Kind(
            "Embedding",
            _is(nn.Embedding),
            1,
            lambda m, g, _, c: ColumnParallelEmbedding.from_dense(m, group=g),
            _check_embedding_columns,
        ),
    ),
    "vocab": (
        Kind(
            "Embedding",
            _is(nn.Embedding),
            0,
            lambda m, g, _, c: VocabParallelEmbedding.from_dense(m, group=g),
            _check_embedding_rows,
        ),
        _LINEAR_COLUMN,
    ),
}
