"""Run a function on N local ranks: the launcher of tests, notebooks and `tessera train`.

Each rank is a fresh process (forked from a forkserver that has only imported torch and tessera,
or spawned: nothing of the parent's threads or CUDA state is inherited) with the parent's
environment plus what `torchrun` would give it, and TESSERA_INIT_FILE, a FileStore
path for rendezvous: no TCP port to pick, so parallel runs cannot collide. The function calls
`tessera.init()` itself, exactly as it would under `torchrun`.

Failure handling is the point of this module. A rank that raises sends its traceback to the
parent; the parent then stops the other ranks (which are usually blocked in a collective waiting
for the failed one) and raises `RankFailedError` naming the rank. A rank that dies without a word
(killed, segfault) is reported by its exit code. Two bounds, never confused: `timeout_s` means
what it means everywhere in tessera, the bound of each blocking wait between ranks (handed to
every rank, where `tessera.init()` reads it); `deadline_s`, off unless asked, bounds the whole
run: past it every rank is stopped and `LaunchTimeout` names the ranks that had not finished.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue as queue_module
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from tessera.errors import LaunchTimeout, RankFailedError
from tessera.runtime.context import TIMEOUT_VARIABLE

__all__ = ["launch", "process_context"]

_GRACE_S = 1.0  # after a failure, how long other ranks may still report before they are stopped


def encode_result(value: Any) -> bytes:
    """A rank's return value as bytes for the parent."""
    # torch.save pickles tensors by value: no shared-memory handles that die with the child.
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def decode_result(payload: bytes) -> Any:
    """The value `encode_result` packed."""
    return torch.load(io.BytesIO(payload), weights_only=False)


def _rank_main(
    fn: Callable[..., Any],
    args: tuple,
    rank: int,
    nproc: int,
    init_file: str,
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
        TESSERA_INIT_FILE=init_file,
    )
    try:
        value = fn(*args)
        results.put(("ok", rank, encode_result(value)))
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        results.put(("error", rank, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    finally:
        from tessera.runtime.context import shutdown

        try:
            shutdown()
        except Exception:  # noqa: BLE001 - the group may be broken by the very failure reported
            pass


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


def launch(
    fn: Callable[..., Any],
    nproc: int,
    *args: Any,
    timeout_s: float | None = None,
    deadline_s: float | None = None,
    env: dict[str, str] | None = None,
    start_method: str = "forkserver",
) -> list[Any]:
    """Run `fn(*args)` on `nproc` local ranks and return their return values, in rank order.

    With the default `start_method="forkserver"` (`"spawn"` where the platform lacks it), ranks
    are forked from a server process that has imported torch and tessera once, so a launch (a
    test, a restart after a failure) starts in a fraction of a second instead of paying the
    import of torch per rank; nothing of this process's threads or state is inherited. `fn` must
    be importable by name, as with `"spawn"` (a module-level function of a module, or of a script
    with an `if __name__ == "__main__":` guard). In a notebook, where functions are not
    importable, pass `start_method="fork"` (Linux, macOS): ranks then inherit `fn` from this
    process.
    `env` adds environment variables to every rank. `timeout_s` bounds each blocking wait of the
    ranks (a collective, a receive; None: the ranks' default, `tessera.runtime.default_timeout_s`),
    exactly as `tessera.init(timeout_s=...)` would; a wait past it raises `CollectiveTimeout` in
    the rank, naming it and the operation. `deadline_s` bounds the whole run (None, the default:
    a run may take as long as it needs). Raises `RankFailedError` for the first rank that raised
    (its traceback included) and `LaunchTimeout` past `deadline_s` seconds.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {nproc}")
    for name, value in (("timeout_s", timeout_s), ("deadline_s", deadline_s)):
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if start_method not in ("spawn", "fork", "forkserver"):
        raise ValueError(f"start_method must be spawn, fork or forkserver, got {start_method!r}")
    context = process_context(start_method)
    results: mp.Queue = context.Queue()
    store_dir = tempfile.mkdtemp(prefix="tessera-launch-")
    init_file = os.path.join(store_dir, "store")
    environment = {**os.environ, **(env or {})}
    if timeout_s is not None:  # what `tessera.init()` reads in each rank
        environment[TIMEOUT_VARIABLE] = str(float(timeout_s))
    processes = [
        context.Process(
            target=_rank_main,
            args=(fn, args, rank, nproc, init_file, environment, results),
            name=f"tessera-rank-{rank}",
        )
        for rank in range(nproc)
    ]
    try:
        for process in processes:
            process.start()
        return _collect(processes, results, deadline_s)
    finally:
        stop_processes(processes)
        shutil.rmtree(store_dir, ignore_errors=True)


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


def _collect(
    processes: list[mp.Process], results: mp.Queue, deadline_s: float | None
) -> list[Any]:
    nproc = len(processes)
    values: dict[int, Any] = {}
    failures: list[tuple[int, str, str]] = []
    deadline = time.monotonic() + (deadline_s if deadline_s is not None else float("inf"))
    silent_seen_at: float | None = None
    while len(values) + len(failures) < nproc:
        now = time.monotonic()
        if now >= deadline:
            if failures:
                break
            raise LaunchTimeout(deadline_s or 0.0, [r for r in range(nproc) if r not in values])
        try:
            message = results.get(timeout=min(0.2, deadline - now))
        except queue_module.Empty:
            silent = _silent_deaths(processes, values, failures)
            if silent:
                # A rank's last message can still be in the pipe when its exit is seen: wait a
                # moment before calling the death silent.
                silent_seen_at = silent_seen_at or time.monotonic()
                if time.monotonic() - silent_seen_at > _GRACE_S:
                    failures.extend(silent)
                    break
            continue
        if message[0] == "ok":
            values[message[1]] = decode_result(message[2])
        else:
            failures.append(message[1:])
            deadline = min(deadline, time.monotonic() + _GRACE_S)
    if failures:
        raise _root_cause(failures + _silent_deaths(processes, values, failures))
    return [values[rank] for rank in range(nproc)]


def _root_cause(failures: list[tuple[int, str, str]]) -> RankFailedError:
    """The failure to report first, with the others listed after it.

    A rank that died without a word is the likelier cause: its peers then fail with connection
    errors that merely echo its death. Otherwise the first rank to report is the cause.
    """
    failures = sorted(failures, key=lambda failure: failure[2] != "")  # stable: silent first
    rank, text, remote_traceback = failures[0]
    others = "".join(f"\n  then rank {r}: {t.splitlines()[0][:200]}" for r, t, _ in failures[1:])
    return RankFailedError(rank, text + others, remote_traceback)


def _silent_deaths(
    processes: list[mp.Process], values: dict[int, Any], failures: list[tuple[int, str, str]]
) -> list[tuple[int, str, str]]:
    """Ranks whose process ended without reporting a result or an error."""
    reported = set(values) | {rank for rank, _, _ in failures}
    return [
        (rank, f"process exited with code {process.exitcode} without reporting", "")
        for rank, process in enumerate(processes)
        if rank not in reported and process.exitcode is not None
    ]
