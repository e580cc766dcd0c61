"""The one block finder: which submodules of a model are its repeated blocks.

A transformer, a ResNet, an MLP tower keep their repeated layers in an `nn.ModuleList` or an
`nn.Sequential`; those children (the ones with trainable parameters, outermost containers only)
are the natural grain of every per-block memory mechanism: ZeRO-3 gathers one at a time
(`tessera.zero.units.find_units`), activation checkpointing recomputes one at a time
(`checkpoint_activations`), GeePS swapping keeps a few resident (`swap_idle`).

They differ in one point, the `callable_only` flag: checkpointing and swapping wrap or hook a
block's own `forward`, so a block that is only a container (an `nn.ModuleDict`/`nn.ModuleList`
whose layers the parent calls one by one) is replaced by its children; a ZeRO-3 unit is gathered
when any module inside it runs, so such a container is one unit as it is.
"""

from __future__ import annotations

from torch import nn

__all__ = ["find_blocks"]

_CONTAINERS = (nn.ModuleList, nn.Sequential)
_NO_FORWARD = (nn.ModuleDict, nn.ModuleList)


def _trainable(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def find_blocks(module: nn.Module, *, callable_only: bool = True) -> list[nn.Module]:
    """Children with trainable parameters of every outermost `nn.ModuleList`/`nn.Sequential`,
    in module order; with `callable_only`, a block without a forward of its own (a ModuleDict
    or ModuleList) is replaced by its children with trainable parameters, recursively."""
    blocks: list[nn.Module] = []

    def add(block: nn.Module) -> None:
        if callable_only and isinstance(block, _NO_FORWARD):
            for child in block.children():
                if _trainable(child):
                    add(child)
        else:
            blocks.append(block)

    def visit(parent: nn.Module) -> None:
        container = isinstance(parent, _CONTAINERS)
        for child in parent.children():
            if container and _trainable(child):
                add(child)
            else:
                visit(child)

    visit(module)
    return blocks
