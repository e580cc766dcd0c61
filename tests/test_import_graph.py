"""The layers of DESIGN.md hold: nothing imports upward, and no module import cycle exists.

Imports are read from the source: every `import` statement, at module level, inside a function,
or under `if TYPE_CHECKING:`. All three count, because each is a dependency of the module's code
on the other module, whether Python runs it at import time or not: a function-level import is
the usual way to hide a circle that would fail at import time, and a `TYPE_CHECKING` import
names a type whose attributes the code uses (often its private ones). Two modules that need
each other that way are one module split by size, not two parts with an interface between them;
the cure is to put what both need where both can import it one way.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import tessera

PACKAGE = Path(tessera.__file__).parent

LAYERS = {
    # layer 4: what users run
    "train": 4, "plan": 4, "viz": 4, "cli": 4, "__main__": 4,
    # layer 3: one entry point
    "strategies": 3,
    # layer 2: the strategy libraries
    "data_parallel": 2, "zero": 2, "pipeline": 2, "tensor_parallel": 2,
    "parameter_server": 2, "federated": 2,
    # layer 1: mechanisms shared by the strategies
    "comm": 1, "memory": 1, "optim": 1, "checkpoint": 1,
    # layer 0: processes, errors, data
    "runtime": 0, "models": 0, "data": 0, "errors": 0,
}  # fmt: skip
"""Layer of each top-level part of the package (DESIGN.md, "Layout")."""

MIXES = {
    ("pipeline", "tensor_parallel"),
    ("pipeline", "zero"),
    ("pipeline", "data_parallel"),
    ("zero", "data_parallel"),
}
"""Strategy libraries allowed to use another's public API, where the mix is the point (DESIGN.md):
the dp x tp x pp hybrid composes pipeline, tensor parallelism and ZeRO/DDP inside stages, and
ZeRO-1/2 reduce-scatter gradients through DDP's own buckets and reducer (one bucketing
mechanism, not two)."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """The tessera modules `path` imports, anywhere in it (`TYPE_CHECKING` blocks included)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and target.startswith("tessera"):
                found.add(target)
    return found


@functools.cache
def _graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(paths)
    graph = {name: _imports(path, name, modules) for name, path in paths.items()}
    # a package's __init__ importing its own submodules is how packages re-export: not an edge
    # that can close a cycle through the package's own modules
    for name in graph:
        graph[name] = {t for t in graph[name] if not (t.startswith(name + ".") and name in paths)}
    return graph


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_part_has_a_layer():
    parts = {_part(m) for m in _graph()} - {"__init__"}
    assert parts <= set(LAYERS), f"give these a layer in DESIGN.md and here: {parts - set(LAYERS)}"


def test_nothing_imports_upward():
    upward = []
    for module, targets in sorted(_graph().items()):
        source = _part(module)
        if source == "__init__":
            continue  # the public API re-exports from every layer
        for target in sorted(targets):
            dest = _part(target)
            if dest == "__init__" or dest == source:
                continue
            if LAYERS[dest] > LAYERS[source] or (
                LAYERS[dest] == LAYERS[source] == 2 and (source, dest) not in MIXES
            ):
                upward.append(f"{module} -> {target}")
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


def test_only_the_trainer_and_the_cli_import_the_planner():
    """tessera.plan is a front (DESIGN.md): what the trainer and the command use, nothing else."""
    importers = {
        module
        for module, targets in _graph().items()
        if any(t == "tessera.plan" or t.startswith("tessera.plan.") for t in targets)
        and not module.startswith("tessera.plan")
    }
    assert all(m == "tessera.cli" or m.startswith("tessera.train") for m in importers), importers


def _knots(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm): every
    module of a knot reaches every other, so each lies on a circle, and every circle lies in one
    knot. Listing knots names every module in a circle, not only the first circle found."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    knots: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            knot = stack[stack.index(node) :]
            del stack[stack.index(node) :]
            if len(knot) > 1:
                knots.append(sorted(knot))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return knots


def test_no_import_cycle_even_through_function_level_or_type_checking_imports():
    """No circle of modules, counting every import (see the module docstring for why)."""
    graph = _graph()
    knots = [
        " <-> ".join(knot)
        + "\n    "
        + ", ".join(f"{a} -> {b}" for a in knot for b in sorted(graph[a]) if b in knot)
        for knot in _knots(graph)
    ]
    assert not knots, "modules in an import circle (and the imports between them):\n" + "\n".join(
        knots
    )


def test_the_circle_finder_finds_a_circle():
    """The check above can fail: a circle through three modules, one import each."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _knots(graph) == [["a", "b", "c"]]
    assert _knots({"a": {"b"}, "b": set()}) == []


def test_the_registry_names_nothing_above_the_strategies():
    """The registry's "module:attr" strings are imports too, made when a name is looked up: none
    may point above layer 3 (the parameter server's job once hid a layer-4 import in one)."""
    from tessera.strategies.registry import BUILTIN_STRATEGIES, OWN_ENTRY_POINTS

    targets = [t for pair in BUILTIN_STRATEGIES.values() for t in pair]
    targets += list(OWN_ENTRY_POINTS.values())
    upward = [t for t in targets if LAYERS[_part(t.partition(":")[0])] > LAYERS["strategies"]]
    assert not upward, f"registry entries above the strategies: {upward}"
