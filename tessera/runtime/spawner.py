"""Start N local processes, one per rank, and gather what they report: the one rank spawner.

Every process tessera starts on this machine comes from here: the ranks of `tessera.launch` (and
so of the tests, the benchmarks and `tessera train`) and the servers and workers of a local
parameter-server run. The skeleton is the same for all:

- a folder only this user can read (`tempfile.mkdtemp`, mode 0700) holding a FileStore file for
  rendezvous: no TCP port to pick, so parallel runs cannot collide;
- one process per rank, forked from a fork server that imported torch and tessera once
  (`process_context`), given the caller's environment as it is now plus RANK, LOCAL_RANK,
  WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK and the store's path;
- each rank runs `fn(*args)` and sends back its value or its exception's traceback; a rank that
  dies without a word (killed, segfault) is noticed by its exit code, after a grace period in
  which its last message may still be in the pipe;
- then every process still running is stopped and the folder removed, however the run ended.

What differs between callers is what a rank's outcome means, and that is the `ResultPolicy`:
`launch` needs every rank's value and ends the run at the first failure (the survivors would hang
in their next collective); the parameter server needs only the coordinator's result and lets
workers fail under ASP/SSP, where the servers drop them and training goes on.
"""

from __future__ import annotations

import io
import math
import multiprocessing as mp
import os
import queue as queue_module
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tessera.runtime.context import shutdown

__all__ = ["ResultPolicy", "process_context", "spawn_ranks", "stop_processes"]

INIT_FILE_VARIABLE = "TESSERA_INIT_FILE"
"""Where a rank finds the store's path by default; `tessera.init()` reads it."""
_POLL_S = 0.2  # how often the parent looks for ranks that died without reporting
_SILENT_GRACE_S = 1.0  # how long a dead rank's last message may still be in the pipe


class ResultPolicy:
    """What a run returns and when it is over, decided from each rank's outcome as it arrives.

    The spawner calls `on_value`, `on_error` or `on_exit` once per rank (in arrival order) until
    one returns True or `deadline` (a `time.monotonic()` instant, checked before every wait)
    passes, then `result` once. Any of them may raise instead: the run then ends with that error.
    """

    deadline: float = math.inf

    def on_value(self, rank: int, value: Any) -> bool:
        """Rank `rank` returned `value`; True if the run is over."""
        raise NotImplementedError

    def on_error(self, rank: int, message: str, remote_traceback: str) -> bool:
        """Rank `rank` raised (`message` is "Type: text"); True if the run is over."""
        raise NotImplementedError

    def on_exit(self, rank: int, exitcode: int) -> bool:
        """Rank `rank`'s process ended with `exitcode` without reporting; True if over."""
        raise NotImplementedError

    def result(self, unreported: dict[int, int | None]) -> Any:
        """What the run returns (or raises), given the ranks that never reported (rank -> exit
        code, None while still running: they are stopped after this call)."""
        raise NotImplementedError


def encode_result(value: Any) -> bytes:
    """A rank's return value as bytes for the parent."""
    # torch.save pickles tensors by value: no shared-memory handles that die with the child.
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def decode_result(payload: bytes) -> Any:
    """The value `encode_result` packed."""
    return torch.load(io.BytesIO(payload), weights_only=False)


def spawn_ranks(
    fn: Callable[..., Any],
    nproc: int,
    args: Sequence[Any],
    policy: ResultPolicy,
    *,
    env: dict[str, str] | None = None,
    init_file_variable: str = INIT_FILE_VARIABLE,
    label: str = "rank",
    start_method: str = "forkserver",
) -> Any:
    """Run `fn(*args)` on `nproc` local processes; return what `policy.result` makes of them.

    `env` adds (or overrides) environment variables of every rank; `init_file_variable` names
    the variable that holds the store's path; `label` names the folder (`tessera-LABEL-*`) and
    the processes (`tessera-LABEL-RANK`). `fn` must be importable by name unless `start_method`
    is "fork" (see `tessera.launch`).
    """
    context = process_context(start_method)
    results: mp.Queue = context.Queue()
    store_dir = tempfile.mkdtemp(prefix=f"tessera-{label}-")
    init_file = os.path.join(store_dir, "store")
    environment = {**os.environ, **(env or {})}
    store = {init_file_variable: init_file}
    processes = [
        context.Process(
            target=_rank_main,
            args=(fn, tuple(args), rank, nproc, store, environment, results),
            name=f"tessera-{label}-{rank}",
        )
        for rank in range(nproc)
    ]
    try:
        for process in processes:
            process.start()
        return _collect(processes, results, policy)
    finally:
        stop_processes(processes)
        shutil.rmtree(store_dir, ignore_errors=True)


def _rank_main(
    fn: Callable[..., Any],
    args: tuple,
    rank: int,
    nproc: int,
    store: dict[str, str],
    environment: dict[str, str],
    results: mp.Queue,
) -> None:
    # A forkserver child starts with the server's environment, which may be older than the
    # caller's: give every rank the caller's environment as it is now, as spawn would.
    os.environ.clear()
    os.environ.update(environment)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        GROUP_RANK="0",
        **store,
    )
    try:
        value = fn(*args)
        results.put(("ok", rank, encode_result(value)))
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        results.put(("error", rank, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    finally:
        try:
            shutdown()
        except Exception:  # noqa: BLE001 - the group may be broken by the very failure reported
            pass


def _collect(processes: list[mp.Process], results: mp.Queue, policy: ResultPolicy) -> Any:
    reported: set[int] = set()
    exited_at: dict[int, float] = {}  # rank -> when its exit was first seen without a message
    over = False
    while not over and time.monotonic() < policy.deadline:
        wait_s = max(0.0, min(_POLL_S, policy.deadline - time.monotonic()))
        try:
            message = results.get(timeout=wait_s)
        except queue_module.Empty:
            message = None
        if message is None:
            for rank in _silent_deaths(processes, reported, exited_at):
                reported.add(rank)
                over = policy.on_exit(rank, processes[rank].exitcode) or over
            continue
        kind, rank = message[0], message[1]
        reported.add(rank)
        if kind == "ok":
            over = policy.on_value(rank, decode_result(message[2]))
        else:
            over = policy.on_error(rank, message[2], message[3])
    unreported = {r: p.exitcode for r, p in enumerate(processes) if r not in reported}
    return policy.result(unreported)


def _silent_deaths(
    processes: list[mp.Process], reported: set[int], exited_at: dict[int, float]
) -> list[int]:
    """Ranks whose process ended over `_SILENT_GRACE_S` ago without a message."""
    now = time.monotonic()
    silent = []
    for rank, process in enumerate(processes):
        if rank in reported or process.exitcode is None:
            continue
        if now - exited_at.setdefault(rank, now) > _SILENT_GRACE_S:
            silent.append(rank)
    return silent


def stop_processes(processes: list[mp.Process]) -> None:
    """Terminate the processes still alive, then kill those that ignore it for 5 s."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join()


_READ_AT_PROCESS_START = ("MALLOC_", "LD_", "PYTHON", "OMP_", "KMP_", "GOMP_", "MKL_", "TORCH_")
"""Prefixes of environment variables that the C library, the interpreter, OpenMP or torch read
when a process starts or imports torch: setting them in a forked rank is too late."""

_server_environment: dict[str, str] | None = None
"""Those variables as they were when this process's fork server started (None: not started)."""


def _start_variables() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(_READ_AT_PROCESS_START)}


def process_context(start_method: str = "forkserver") -> Any:
    """The multiprocessing context; a forkserver preloads torch and tessera for its children.

    One preload list for every process tessera starts (ranks, parameter servers and workers):
    the server is started once per process, with the list set when it starts. Ranks get the
    caller's current environment, but variables read at process start (`MALLOC_*`,
    `OMP_NUM_THREADS`, `LD_PRELOAD`, ...) take effect only in a new interpreter: when they differ
    from the server's, this launch spawns instead.
    """
    global _server_environment
    if start_method != "forkserver":
        return mp.get_context(start_method)
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    if _server_environment is None:
        _server_environment = _start_variables()
    elif _server_environment != _start_variables():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    # Takes effect when the server starts (the first forkserver launch of this process).
    # "__main__" keeps functions of the caller's script importable in the ranks.
    context.set_forkserver_preload(["__main__", "tessera.runtime._preload"])
    return context
