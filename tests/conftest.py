"""Shared test helpers: the multi-rank runner every distributed test uses."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

import tessera

SPAWN_TIMEOUT_S = 120.0
"""Hard bound of one multi-rank test: a hang fails the test instead of the whole suite."""


@pytest.fixture
def run_ranks() -> Callable[..., list[Any]]:
    """`run_ranks(fn, nproc, *args)`: `tessera.launch` with the suite's hard deadline."""

    def run(fn: Callable[..., Any], nproc: int, *args: Any, deadline_s: float = SPAWN_TIMEOUT_S):
        return tessera.launch(fn, nproc, *args, deadline_s=deadline_s)

    return run


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `gpu`-marked tests, with the reason, where CUDA is absent (they run on GPU hosts)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: no GPU on this machine (runs on GPU hosts)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
