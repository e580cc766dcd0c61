"""Apply tensor parallelism to a dense module by a plan, and gather the dense state back.

`parallelize(module, {"mlp.up": "column", "mlp.proj": "row"}, group=tp_group)` replaces each
submodule whose name matches a pattern (fnmatch) by its parallel version, slicing its existing
weights, so the result computes what the dense module did. Styles:

- "column": nn.Linear -> ColumnParallelLinear (output features split);
  nn.Conv2d -> ChannelParallelConv2d (output channels split, gathered after unless a "row"
  Conv2d takes them split).
- "row": nn.Linear -> RowParallelLinear (input features split; follows a column layer);
  nn.Conv2d -> RowParallelConv2d (input channels split, partial outputs summed).
- "vocab": nn.Embedding -> VocabParallelEmbedding; nn.Linear -> ColumnParallelLinear whose split
  logits feed `vocab_parallel_cross_entropy`.
- "column_gather": nn.Linear -> ColumnParallelLinear with its output all-gathered.

A "row" Conv2d pairs with the nearest "column" Conv2d registered before it (module order), as
the MLP's two linears pair: the column conv then keeps its output channels split, only
channel-wise layers (activations, pooling) may sit between the two, and the pair all-reduces
once forward and once backward. The plan is refused if a row conv has no column conv before it
or the column conv's output channels are not the row conv's input channels.

Every check (a pattern matching nothing, a module matched by two patterns, a wrong module type,
a dimension the group size does not divide, an unpaired or mismatched row conv, a grouped conv)
raises ValueError before any module is changed or any message sent.
"""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatch

import torch
import torch.distributed as dist
from torch import nn

from tessera.tensor_parallel._comm import all_gather_dim, group_size
from tessera.tensor_parallel.layers import (
    ChannelParallelConv2d,
    ColumnParallelLinear,
    RowParallelConv2d,
    RowParallelLinear,
    VocabParallelEmbedding,
    _Parallel,
    check_splittable_conv,
)

__all__ = ["STYLES", "full_state_dict", "parallelize"]

STYLES = ("column", "row", "vocab", "column_gather")

# style -> {dense type: (split dimension of the weight, builder(module, group, paired))};
# `paired`: a column conv whose output channels a row conv takes split (not gathered)
_BUILDERS = {
    "column": {
        nn.Linear: (0, lambda m, g, _: ColumnParallelLinear.from_dense(m, group=g)),
        nn.Conv2d: (
            0,
            lambda m, g, paired: ChannelParallelConv2d.from_dense(
                m, group=g, gather_output=not paired
            ),
        ),
    },
    "column_gather": {
        nn.Linear: (
            0,
            lambda m, g, _: ColumnParallelLinear.from_dense(m, group=g, gather_output=True),
        )
    },
    "row": {
        nn.Linear: (1, lambda m, g, _: RowParallelLinear.from_dense(m, group=g)),
        nn.Conv2d: (1, lambda m, g, _: RowParallelConv2d.from_dense(m, group=g)),
    },
    "vocab": {
        nn.Embedding: (0, lambda m, g, _: VocabParallelEmbedding.from_dense(m, group=g)),
        nn.Linear: (0, lambda m, g, _: ColumnParallelLinear.from_dense(m, group=g)),
    },
}


def _pair_convolutions(targets: list[tuple[str, str, nn.Module]]) -> set[str]:
    """Names of the column convs a row conv follows (their output stays split); ValueError for
    a row conv without a matching column conv before it."""
    paired: set[str] = set()
    open_column: tuple[str, nn.Module] | None = None  # the last unpaired column conv
    for name, style, sub in targets:
        if not isinstance(sub, nn.Conv2d):
            continue
        if style == "column":
            open_column = (name, sub)
        elif style == "row":
            if open_column is None:
                raise ValueError(
                    f"{name}: a row-parallel Conv2d takes input channels split by a column-"
                    f"parallel Conv2d before it; the plan has none (add one as 'column')"
                )
            column_name, column = open_column
            if column.out_channels != sub.in_channels:
                raise ValueError(
                    f"{name}: its {sub.in_channels} input channels do not match the "
                    f"{column.out_channels} output channels of the column conv {column_name}"
                )
            paired.add(column_name)
            open_column = None
    return paired


def _plan_targets(
    module: nn.Module, plan: Mapping[str, str], size: int
) -> list[tuple[str, str, nn.Module]]:
    """Validate `plan` against `module`; return `(name, style, submodule)` to replace, in the
    module's registration order."""
    named = dict(module.named_modules())
    order = {name: k for k, name in enumerate(named)}
    targets: list[tuple[str, str, nn.Module]] = []
    chosen: dict[str, str] = {}  # module name -> the pattern that matched it
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ValueError(
                f"unknown tensor-parallel style {style!r} for {pattern!r}; use {STYLES}"
            )
        matches = [name for name in named if name and fnmatch(name, pattern)]
        if not matches:
            raise ValueError(f"plan pattern {pattern!r} matches no submodule")
        for name in matches:
            if name in chosen:  # one module, two styles: which one wins would be silent
                raise ValueError(
                    f"{name} matches plan patterns {chosen[name]!r} and {pattern!r}; "
                    f"give each module one style"
                )
            chosen[name] = pattern
            sub = named[name]
            kind = next((t for t in _BUILDERS[style] if type(sub) is t), None)
            if kind is None:
                allowed = [t.__name__ for t in _BUILDERS[style]]
                raise ValueError(
                    f"{name} is a {type(sub).__name__}; style {style!r} takes {allowed}"
                )
            if kind is nn.Conv2d:
                check_splittable_conv(sub, name)
            dim = _BUILDERS[style][kind][0]
            if sub.weight.shape[dim] % size:
                raise ValueError(
                    f"{name}: weight dimension {dim} ({sub.weight.shape[dim]}) is not divisible "
                    f"by the tensor-parallel size {size}"
                )
            targets.append((name, style, sub))
    return sorted(targets, key=lambda target: order[target[0]])


def parallelize(
    module: nn.Module, plan: Mapping[str, str], *, group: dist.ProcessGroup | None = None
) -> nn.Module:
    """Replace the submodules `plan` names by tensor-parallel versions in place; return `module`."""
    targets = _plan_targets(module, plan, group_size(group))
    paired = _pair_convolutions(targets)
    for name, style, sub in targets:
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        builder = _BUILDERS[style][type(sub)][1]
        setattr(parent, child, builder(sub, group, name in paired))
    return module


def _gather_param(
    tensor: torch.Tensor, layer: _Parallel, dim: int, group: dist.ProcessGroup | None
) -> torch.Tensor:
    gathered = all_gather_dim(tensor.detach(), group, dim)
    if layer.chunks == 1:
        return gathered
    # each rank holds [chunk_0 slice, chunk_1 slice, ...]: regroup slices by chunk
    size = group_size(group)
    per_rank = gathered.chunk(size, dim=dim)
    pieces = [part.chunk(layer.chunks, dim=dim) for part in per_rank]
    return torch.cat([pieces[r][c] for c in range(layer.chunks) for r in range(size)], dim=dim)


def full_state_dict(
    module: nn.Module, *, group: dist.ProcessGroup | None = None
) -> dict[str, torch.Tensor]:
    """The dense module's state dict, split parameters all-gathered; collective over `group`."""
    state: dict[str, torch.Tensor] = {}
    layers = {name: sub for name, sub in module.named_modules() if isinstance(sub, _Parallel)}
    for key, value in module.state_dict().items():
        owner, _, leaf = key.rpartition(".")
        layer = layers.get(owner)
        if layer is not None and leaf in layer.shard_dims:
            value = _gather_param(value, layer, layer.shard_dims[leaf], group)
        state[key] = value.detach().clone()
    return state
