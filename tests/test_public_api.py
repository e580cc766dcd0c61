"""Every public name has a test: a cheap guard that a new export does not land untested.

The public names are the `__all__` of every tessera package (`tessera`, `tessera.comm`, ...)
and of its top-level public modules (`tessera.errors`, `tessera.cli`). Each must appear,
as a whole word, in at least one test file other than this one. Appearing is not being tested,
but every name listed here today has a test that exercises its body (test_public_names.py holds
those that were only reached indirectly); the guard keeps the next export from slipping by.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import tessera

TESTS = Path(__file__).parent


def public_modules() -> list[str]:
    """tessera, its packages at any depth, and its top-level modules not starting with '_'."""
    names = {"tessera"}
    for info in pkgutil.walk_packages(tessera.__path__, "tessera."):
        leaf = info.name.rsplit(".", 1)[1]
        top_level = info.name.count(".") == 1
        if info.ispkg or (top_level and not leaf.startswith("_")):
            names.add(info.name)
    names.discard("tessera.__main__")  # running it parses the command line
    return sorted(names)


def public_names() -> dict[str, list[str]]:
    """Name -> the modules whose `__all__` lists it."""
    found: dict[str, list[str]] = {}
    for module_name in public_modules():
        module = importlib.import_module(module_name)
        for name in getattr(module, "__all__", ()):
            assert hasattr(module, name), f"{module_name}.__all__ lists {name!r}, not defined"
            found.setdefault(name, []).append(module_name)
    return found


def test_the_guard_sees_the_packages():
    modules = public_modules()
    for expected in ("tessera.zero", "tessera.data_parallel", "tessera.train", "tessera.errors"):
        assert expected in modules
    assert len(public_names()) > 50


def test_every_public_name_appears_in_a_test():
    sources = [
        path.read_text() for path in sorted(TESTS.glob("*.py")) if path.name != Path(__file__).name
    ]
    untested = {
        name: modules
        for name, modules in public_names().items()
        if not any(re.search(rf"\b{re.escape(name)}\b", text) for text in sources)
    }
    assert not untested, f"public names no test mentions (add a test that calls them): {untested}"
