"""ZeRO-3's units: which modules are gathered as one, and which unit owns each parameter.

A unit is ZeRO-3's grain (Rajbhandari et al., SC 2020, section 5.3): one flat parameter buffer
that a rank holds only a slice of, all-gathered as a whole before any of its modules runs, and
one gradient bucket. FSDP2 calls it a module wrapped with `fully_shard`. Smaller units hold less
memory at a time; larger ones send fewer, bigger messages.

By default (`find_units`) every child of an `nn.ModuleList` or `nn.Sequential` that has trainable
parameters is a unit (a GPT block, an MLP layer). `units=` chooses them instead, by module class
(`isinstance`) or by name pattern (`fnmatch` per dotted component: `"blocks.*"` is every direct
child of `blocks`, not their children). Everything no unit holds belongs to the root unit 0.

Units may nest (`units=["blocks.*", "blocks.*.mlp"]`): a parameter belongs to the innermost unit
above it. A parameter reachable from two units that do not nest (a tied weight) belongs to the
root, which is gathered for the whole forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from fnmatch import fnmatchcase

from torch import nn

from tessera.memory.blocks import find_blocks

__all__ = ["UnitSpec", "find_units", "parameter_owners", "select_units"]

UnitSpec = type[nn.Module] | str
"""A module class (every submodule that is an instance of it) or a dotted name pattern."""


def find_units(module: nn.Module) -> list[nn.Module]:
    """Children of `nn.ModuleList`/`nn.Sequential` containers that have parameters, outermost
    (`tessera.memory.blocks.find_blocks`; a container child is one unit, gathered whole)."""
    return find_blocks(module, callable_only=False)


def _matches(pattern: str, name: str) -> bool:
    """`fnmatch` per dotted component, so that `*` never crosses a dot."""
    parts, pattern_parts = name.split("."), pattern.split(".")
    return len(parts) == len(pattern_parts) and all(
        fnmatchcase(part, want) for part, want in zip(parts, pattern_parts)
    )


def select_units(
    module: nn.Module, units: Sequence[UnitSpec] | UnitSpec | None = None
) -> list[nn.Module]:
    """The submodules `units` names, in module order (`None`: `find_units`).

    Raises `TypeError` for an entry that is neither a module class nor a string, and
    `ValueError` naming an entry that matches no submodule (a typo would otherwise leave the
    whole model in the root unit, gathered at once, silently).
    """
    if units is None:
        return find_units(module)
    specs = [units] if isinstance(units, (str, type)) else list(units)
    named = [(name, sub) for name, sub in module.named_modules() if name]  # the root is unit 0
    chosen: set[int] = set()
    for spec in specs:
        if isinstance(spec, str):
            found = [sub for name, sub in named if _matches(spec, name)]
        elif isinstance(spec, type) and issubclass(spec, nn.Module):
            found = [sub for _, sub in named if isinstance(sub, spec)]
        else:
            raise TypeError(
                f"units= takes module classes or name patterns (str), got {spec!r} "
                f"of type {type(spec).__name__}"
            )
        if not found:
            examples = ", ".join(name for name, _ in named[:6]) or "none"
            what = spec if isinstance(spec, str) else spec.__name__
            raise ValueError(
                f"units= entry {what!r} matches no submodule of {type(module).__name__} "
                f"(its submodules are named like: {examples})"
            )
        chosen.update(id(sub) for sub in found)
    return [sub for _, sub in named if id(sub) in chosen]


def parameter_owners(module: nn.Module, units: Sequence[nn.Module]) -> dict[int, int]:
    """`id(parameter) -> unit`: 0 for the root, `i` for `units[i - 1]`.

    A parameter belongs to the innermost unit on the path from the root to the module that
    holds it; if two paths (a shared module, a tied weight) lead to different units, to the root.
    """
    index = {id(unit): position for position, unit in enumerate(units, start=1)}
    found: dict[int, set[int]] = {}

    def visit(current: nn.Module, unit: int, path: frozenset[int]) -> None:
        unit = index.get(id(current), unit) if current is not module else 0
        for param in current._parameters.values():
            if param is not None:
                found.setdefault(id(param), set()).add(unit)
        for child in current.children():
            if id(child) not in path:  # a module holding itself would recurse forever
                visit(child, unit, path | {id(child)})

    visit(module, 0, frozenset({id(module)}))
    return {key: next(iter(owners)) if len(owners) == 1 else 0 for key, owners in found.items()}
