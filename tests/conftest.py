"""Shared test helpers: the multi-rank runner every distributed test uses."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch.distributed as dist

import tessera
from tessera.runtime.devices import BACKEND_ENV

os.environ[BACKEND_ENV] = "gloo"
"""Also before any test module is imported: a module that copies the environment at import
(`ENV = {**os.environ, ...}` for its subprocesses) must see gloo too. On a one-GPU machine
test_cli's `tessera run -n 2` got NCCL from such a copy and was refused for want of a second GPU.
`gpu` tests take it away again (`_backend_of_the_test`)."""

SPAWN_TIMEOUT_S = 120.0
"""Hard bound of one multi-rank test: a hang fails the test instead of the whole suite."""


@pytest.fixture
def run_ranks() -> Callable[..., list[Any]]:
    """`run_ranks(fn, nproc, *args)`: `tessera.launch` with the suite's hard deadline."""

    def run(fn: Callable[..., Any], nproc: int, *args: Any, deadline_s: float = SPAWN_TIMEOUT_S):
        return tessera.launch(fn, nproc, *args, deadline_s=deadline_s)

    return run


@pytest.fixture(autouse=True)
def _backend_of_the_test(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test but a `gpu` one runs its ranks on the CPU with gloo, whatever GPUs are visible.

    Without it a machine with CUDA would give each rank NCCL and the GPU of its LOCAL_RANK: a
    2-rank test on a one-GPU machine then fails in rank 1 ("invalid device ordinal"), and the
    CPU tests' oracles would meet CUDA tensors. The variable reaches every rank (`tessera.launch`)
    and every `tessera train` subprocess through the environment. `gpu` tests pick the backend
    `tessera.init` chooses (NCCL with CUDA) and start as many ranks as there are GPUs.
    """
    if request.node.get_closest_marker("gpu") is not None:
        monkeypatch.delenv(BACKEND_ENV, raising=False)
    else:
        monkeypatch.setenv(BACKEND_ENV, "gloo")


@pytest.fixture(autouse=True)
def _no_process_group_left_behind():
    """Leave the process group a test joined in the pytest process itself.

    `tessera.setup` without `ctx=` calls `tessera.init`, which joins a one-rank group that
    outlived its test: a later test on the same xdist worker that asserts no group exists
    (`test_setup_state`'s refusals "before tessera.init") then failed, depending on the order
    `--dist worksteal` gave the tests."""
    yield
    if dist.is_initialized():
        tessera.shutdown()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `gpu`-marked tests, with the reason, where CUDA is absent (they run on GPU hosts)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: no GPU on this machine (runs on GPU hosts)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
